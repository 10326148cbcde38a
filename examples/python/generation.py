"""kvscore.generation inside transformers' generate (docs/guides/generation.md): SmolLM2-135M-Instruct
answers a question about a fact planted in a 1K-token context, once with ParisKV attending 10 % of
the keys per decoded token, once with OjaKV's low-rank store at about half the K/V memory, and
with ParisKV in kvpress's own pipeline. Needs
the SmolLM2 GGUF (bash scripts/fetch_smollm2.sh) and the gguf package."""

import torch

from kvscore import quality


def main(model=None, tok=None):
    if model is None:
        model, tok = quality.load_model()  # fp32, sdpa attention; $KVSCORE_SMOLLM2 or .models/
    ctx = quality.make_contexts(tok, [1024], {1024: 1})[0]
    question, prefix, expected = quality.questions(ctx)[0]
    chat = tok.apply_chat_template([{"role": "user", "content": ctx.text + "\n\n" + question}],
                                   add_generation_prompt=True, tokenize=False) + prefix
    ids = tok(chat, return_tensors="pt", add_special_tokens=False).input_ids
    answers = []
    # [generation:begin]
    import kvscore.generation as kg

    # every decoded token attends to 4 sinks, the 64 newest tokens and the keys ParisKV's index
    # retrieves for its own query: 10 % of the prompt's keys in all (dense_below=0: also at 1K
    # tokens, where by default the cache attends densely, which is faster there)
    cache = kg.RetrievalCache(model, method="pariskv", attend=0.1, sinks=4, local=64, dense_below=0)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    print(tok.decode(out[0, ids.shape[1]:]), cache.memory_bytes() / cache.full_memory_bytes())
    # [generation:end]
    answers.append(tok.decode(out[0, ids.shape[1]:]))
    # [generation-ojakv:begin]
    # OjaKV: rank-16 codes for most tokens, a third of them kept at full rank (anchors)
    cache = kg.OjaKVCache(model, rank=16, anchors=0.33)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    print(tok.decode(out[0, ids.shape[1]:]), cache.memory_bytes() / cache.full_memory_bytes())
    # [generation-ojakv:end]
    answers.append(tok.decode(out[0, ids.shape[1]:]))
    # [generation-pipeline:begin]
    from transformers import pipeline

    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" task)

    # kvpress's own pipeline: the context is the prompt, the question runs through the cache
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    cache = kg.RetrievalCache(model, method="pariskv", attend=0.1, sinks=4, local=64, dense_below=0)
    answer = pipe(ctx.text, question=question, answer_prefix=prefix, cache=cache, max_new_tokens=4)["answer"]
    print(answer)
    # [generation-pipeline:end]
    answers.append(answer)
    full = model.generate(ids, max_new_tokens=4, do_sample=False)
    answers.append(tok.decode(full[0, ids.shape[1]:]))
    print(f"expected {expected}; the full cache answers {answers[-1]}")
    return expected, answers


if __name__ == "__main__":
    with torch.inference_mode():
        main()
