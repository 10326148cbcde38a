// The .safetensors reader (kvscore/io/safetensors.hpp) and Q-Filters in the authors' published
// convention (issue 18, defect 1): fixtures written by tools/gen_qfilter_published_fixtures.py
// (plain Python struct/json), the same filters as F32, F16 and BF16; scores checked bit for bit
// against -<f, k> computed in fp64 (every product and sum is exact: multiples of 1/8).
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include <kvscore/io/npy.hpp>
#include <kvscore/io/safetensors.hpp>
#include <kvscore/io/qfilter_file.hpp>
#include <kvscore/scorers/qfilter.hpp>

namespace {

using Catch::Matchers::Contains;

std::string data_path(const std::string& f) { return std::string(KVSCORE_TEST_DATA_DIR) + "/" + f; }

std::vector<float> published_values() {  // C order [3][2][8], from the generator
  std::ifstream f(data_path("qfilters_published_values.txt"));
  std::vector<float> v;
  for (double x; f >> x;) v.push_back(float(x));
  REQUIRE(v.size() == 3 * 2 * 8);
  return v;
}

std::vector<std::uint8_t> file_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// A safetensors file from a header string and data bytes.
std::vector<std::uint8_t> make_file(const std::string& header, std::size_t data_bytes) {
  std::vector<std::uint8_t> b(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) b[std::size_t(i)] = std::uint8_t(n >> (8 * i));
  std::copy(header.begin(), header.end(), b.begin() + 8);
  return b;
}

std::string parse_error(const std::vector<std::uint8_t>& b, const std::string& name = "q_filters") {
  try {
    kvscore::safetensors::parse(b.data(), b.size(), name, "f.safetensors");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors: F32, F16 and BF16 files give the generator's values", "[safetensors]") {
  const std::vector<float> want = published_values();
  for (const char* dt : {"f32", "f16", "bf16"}) {
    INFO(dt);
    const auto t = kvscore::safetensors::load(data_path(std::string("qfilters_published_") + dt + ".safetensors"),
                                              "q_filters");
    CHECK(t.shape == std::vector<std::int64_t>{3, 2, 8});
    CHECK(t.values == want);
  }
}

TEST_CASE("safetensors: malformed files are errors naming the file and the fault", "[safetensors][errors]") {
  CHECK_THAT(parse_error(std::vector<std::uint8_t>(5, 0)), Contains("f.safetensors: file of 5 bytes is too short"));
  auto b = make_file("{}", 0);
  b[0] = 200;  // header length past the end
  CHECK_THAT(parse_error(b), Contains("header length 200 runs past the end of the file (10 bytes)"));
  CHECK_THAT(parse_error(make_file("{not json", 0)), Contains("header is not a JSON object"));
  CHECK_THAT(parse_error(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4)),
             Contains("no tensor 'q_filters' (tensors: \"a\")"));
  const std::string h1 = R"({"q_filters":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})";
  CHECK_THAT(parse_error(make_file(h1, 8)), Contains("dtype 'I64' (supported: F32, F16, BF16)"));
  const std::string h2 = R"({"q_filters":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}})";
  CHECK_THAT(parse_error(make_file(h2, 8)), Contains("holds a value that is not a count"));
  const std::string h3 = R"({"q_filters":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  CHECK_THAT(parse_error(make_file(h3, 8)), Contains("span 8 bytes, but shape [3] of F32 needs 12"));
  const std::string h4 = R"({"q_filters":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}})";
  CHECK_THAT(parse_error(make_file(h4, 6)), Contains("data_offsets [0, 8] are not within the 6 data bytes"));
  const std::string h5 = R"({"q_filters":{"dtype":"F32","shape":[1]}})";
  CHECK_THAT(parse_error(make_file(h5, 4)), Contains("lacks dtype, shape or data_offsets"));
  CHECK_THROWS_WITH(kvscore::safetensors::load(data_path("no_such.safetensors"), "q_filters"), Contains("cannot open"));
  // a truncated copy of a real fixture
  std::vector<std::uint8_t> f = file_bytes(data_path("qfilters_published_f32.safetensors"));
  f.resize(f.size() - 4);
  CHECK_THAT(parse_error(f), Contains("are not within the"));
}

TEST_CASE("qfilter: published filters score -<f, k> (the authors' ranking), kvscore's convention +<k, f>", "[qfilter][golden]") {
  const std::vector<float> f = published_values();
  const std::int64_t H = 2, N = 40, d = 8;
  std::vector<float> k(std::size_t(H * N * d));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = float(int((i * 37 + 11) % 33) - 16) / 8.f;
  const kvscore::KeysView<float> view(k.data(), H, N, d, N * d, d);
  const std::string npy =
      (std::filesystem::temp_directory_path() / ("kvscore_qfilters_" + std::to_string(::getpid()) + ".npy")).string();
  kvscore::npy::save<float>(npy, {3, 2, 8}, f.data());
  for (std::int64_t layer = 0; layer < 3; ++layer) {
    INFO("layer " << layer);
    for (const char* dt : {"f32", "f16", "bf16"}) {
      INFO(dt);
      const std::string st = data_path(std::string("qfilters_published_") + dt + ".safetensors");
      const kvscore::Scores pub = kvscore::QFilter::from_published(st, layer).score(view);
      const kvscore::Scores as_kvscore = kvscore::QFilter::load(st, layer, kvscore::FilterConvention::kvscore).score(view);
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < N; ++t) {
          double dot = 0;  // exact: multiples of 1/8
          for (std::int64_t j = 0; j < d; ++j)
            dot += double(f[std::size_t((layer * H + h) * d + j)]) * double(k[std::size_t((h * N + t) * d + j)]);
          CHECK(pub(h, t) == float(-dot));
          CHECK(as_kvscore(h, t) == float(dot));
        }
    }
    // the .npy of the same values is kvscore's convention unless told otherwise
    const kvscore::Scores n = kvscore::QFilter::load(npy, layer, kvscore::QFilter::file_convention(npy)).score(view);
    const kvscore::Scores np = kvscore::QFilter::load(npy, layer, kvscore::FilterConvention::published).score(view);
    const kvscore::Scores pub = kvscore::QFilter::from_published(data_path("qfilters_published_f32.safetensors"), layer)
                                    .score(view);
    CHECK(np.values() == pub.values());
    for (std::size_t i = 0; i < n.values().size(); ++i) CHECK(n.values()[i] == -pub.values()[i]);
  }
  std::remove(npy.c_str());
  CHECK(kvscore::QFilter::file_convention("a/b.safetensors") == kvscore::FilterConvention::published);
  CHECK(kvscore::QFilter::file_convention("a/b.npy") == kvscore::FilterConvention::kvscore);
  CHECK_THROWS_WITH(kvscore::QFilter::from_published(data_path("qfilters_published_f32.safetensors"), 3),
                    Contains("layer 3 out of range [0, 3)"));
}
