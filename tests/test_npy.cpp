// Tests of kvscore/io/npy.hpp: round trips, the exact bytes written, real NumPy files,
// and every error path of the reader.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "kvscore/io/npy.hpp"

namespace fs = std::filesystem;
namespace npy = kvscore::npy;

namespace {

/// A per-process scratch directory, removed at exit.
struct ScratchDir {
  fs::path path;
  ScratchDir() : path(fs::temp_directory_path() / ("kvscore_test_npy_" + std::to_string(static_cast<long long>(::getpid())))) {
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

fs::path temp_dir() {
  static const ScratchDir dir;
  return dir.path;
}

std::string temp_file(const std::string& name) { return (temp_dir() / name).string(); }

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string data_file(const std::string& name) { return std::string(KVSCORE_TEST_DATA_DIR) + "/npy/" + name; }

/// A .npy image with the given raw header dict text (padded per the spec) and body.
std::string make_npy(const std::string& dict, const std::string& body, int major = 1) {
  const std::size_t pre = major == 1 ? 10 : 12;
  std::string h = dict;
  while ((pre + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out("\x93NUMPY", 6);
  out += char(major);
  out += '\0';
  for (std::size_t i = 0; i < pre - 8; ++i) out += char((h.size() >> (8 * i)) & 0xff);
  return out + h + body;
}

npy::Array parse_str(const std::string& s) { return npy::parse(s.data(), s.size(), "mem"); }

std::string f4_body(int n) { return std::string(std::size_t(n) * 4, '\0'); }

const std::string kDict23 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";

template <class T>
void round_trip(const std::vector<T>& values, const std::vector<std::int64_t>& shape) {
  const std::string path = temp_file(std::string("rt_") + npy::descr_of<T>() + ".npy");
  npy::save(path, shape, values.data());
  const npy::Array a = npy::load(path);
  CHECK(a.descr == npy::descr_of<T>());
  CHECK(a.shape == shape);
  CHECK(a.size() == std::int64_t(values.size()));
  const std::vector<T> back = a.to_vector<T>();
  REQUIRE(back.size() == values.size());
  for (std::size_t i = 0; i < values.size(); ++i) CHECK(back[i] == values[i]);
  if (!values.empty()) CHECK(std::memcmp(a.as<T>(), values.data(), values.size() * sizeof(T)) == 0);
  // The file is a whole number of 64-byte header blocks plus the data.
  CHECK((read_bytes(path).size() - values.size() * sizeof(T)) % 64 == 0);
}

}  // namespace

TEST_CASE("npy: descr_of", "[npy]") {
  CHECK(std::string(npy::descr_of<float>()) == "<f4");
  CHECK(std::string(npy::descr_of<double>()) == "<f8");
  CHECK(std::string(npy::descr_of<kvscore::half>()) == "<f2");
  CHECK(std::string(npy::descr_of<kvscore::bfloat16>()) == "<u2");
  CHECK(std::string(npy::descr_of<std::int64_t>()) == "<i8");
  CHECK(std::string(npy::descr_of<std::uint16_t>()) == "<u2");
  CHECK(std::string(npy::descr_of<std::int32_t>()) == "<i4");
  CHECK(std::string(npy::descr_of<std::uint8_t>()) == "|u1");
}

TEST_CASE("npy: round trips", "[npy]") {
  round_trip<float>({1.5f, -2.f, 0.f, 3.25f, 1e-30f, -7.f}, {2, 3});
  round_trip<double>({1.0, -2.5, 1e300}, {3});
  round_trip<kvscore::half>({kvscore::half{0x3c00}, kvscore::half{0xc000}, kvscore::half{0x7c00}, kvscore::half{1}},
                            {2, 2});
  round_trip<kvscore::bfloat16>({kvscore::bfloat16{0x3f80}, kvscore::bfloat16{0xbf80}}, {1, 2, 1});
  round_trip<std::int64_t>({-1, 0, INT64_MAX, INT64_MIN}, {4});
  round_trip<std::uint16_t>({0, 65535, 7}, {3});
  round_trip<std::int32_t>({-5, 5}, {2, 1});
  round_trip<std::uint8_t>({0, 1, 255}, {3});
  round_trip<float>({42.f}, {});             // 0-d
  round_trip<float>({}, {0, 3});             // empty
  round_trip<float>({}, {4, 0, 2});          // empty in the middle
}

TEST_CASE("npy: header bytes match the spec exactly", "[npy]") {
  const std::string path = temp_file("exact.npy");
  const std::vector<float> v = {0, 1, 2, 3, 4, 5};
  npy::save<float>(path, {2, 3}, v.data());
  // magic, version 1.0, little-endian uint16 header length, dict, spaces, '\n';
  // 10 + 59 + 58 + 1 = 128 bytes of header.
  std::string expected("\x93NUMPY\x01\x00", 8);
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  REQUIRE(dict.size() == 59);
  const std::size_t hlen = 128 - 10;
  expected += char(hlen & 0xff);
  expected += char(hlen >> 8);
  expected += dict + std::string(hlen - dict.size() - 1, ' ') + "\n";
  expected.append(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  CHECK(read_bytes(path) == expected);

  CHECK(npy::make_header("<i8", {5}) ==
        std::string("\x93NUMPY\x01\x00\x76\x00", 10) + "{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }" +
            std::string(128 - 10 - 57 - 1, ' ') + "\n");
  CHECK(npy::make_header("<f8", {}).find("'shape': (), }") != std::string::npos);
  CHECK(npy::make_header("<f8", {}).size() % 64 == 0);
}

TEST_CASE("npy: header too long for 1.0 is written as 2.0", "[npy]") {
  // 22000 dims of "1, " make a dict of ~66 KB, over the 65535-byte limit of version 1.0.
  std::vector<std::int64_t> shape(22000, 1);
  const std::string h = npy::make_header("<f4", shape);
  REQUIRE(h.size() > 0xffff);
  CHECK(h[6] == 2);
  CHECK(h.size() % 64 == 0);
  const std::uint32_t len = std::uint32_t((unsigned char)h[8]) | std::uint32_t((unsigned char)h[9]) << 8 |
                            std::uint32_t((unsigned char)h[10]) << 16 | std::uint32_t((unsigned char)h[11]) << 24;
  CHECK(len == h.size() - 12);
  // The reader caps dimensions at 64, so this header is (correctly) refused on read.
  const std::string file = h + std::string(4, '\0');
  CHECK_THROWS_WITH(parse_str(file), Catch::Contains("more than 64 dimensions"));
}

TEST_CASE("npy: files written by numpy parse", "[npy]") {
  {
    const npy::Array a = npy::load(data_file("numpy_f4_2x3_arange.npy"));
    CHECK(a.descr == "<f4");
    CHECK(a.shape == std::vector<std::int64_t>{2, 3});
    CHECK(a.to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4, 5});
  }
  {
    const npy::Array a = npy::load(data_file("numpy_f4_v2_2x3_arange.npy"));
    CHECK(a.descr == "<f4");
    CHECK(a.shape == std::vector<std::int64_t>{2, 3});
    CHECK(a.to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4, 5});
  }
  {
    const npy::Array a = npy::load(data_file("numpy_f2_2x3_arange.npy"));
    CHECK(a.descr == "<f2");
    CHECK(a.shape == std::vector<std::int64_t>{2, 3});
    const auto v = a.to_vector<kvscore::half>();
    REQUIRE(v.size() == 6);
    for (int i = 0; i < 6; ++i) CHECK(kvscore::to_float(v[std::size_t(i)]) == 0.5f * float(i));
  }
  {
    const npy::Array a = npy::load(data_file("numpy_i8_4_minus2.npy"));
    CHECK(a.descr == "<i8");
    CHECK(a.to_vector<std::int64_t>() == std::vector<std::int64_t>{-2, -1, 0, 1});
  }
  {
    const npy::Array a = npy::load(data_file("numpy_f8_0d_3p25.npy"));
    CHECK(a.descr == "<f8");
    CHECK(a.shape.empty());
    CHECK(a.size() == 1);
    CHECK(*a.as<double>() == 3.25);
  }
  {
    const npy::Array a = npy::load(data_file("numpy_u1_3.npy"));
    CHECK(a.descr == "|u1");
    CHECK(a.to_vector<std::uint8_t>() == std::vector<std::uint8_t>{1, 2, 255});
  }
  {
    const npy::Array a = npy::load(data_file("numpy_f4_0x3_empty.npy"));
    CHECK(a.shape == std::vector<std::int64_t>{0, 3});
    CHECK(a.size() == 0);
    CHECK(a.bytes.empty());
  }
  CHECK_THROWS_WITH(npy::load(data_file("numpy_f4_fortran_2x3.npy")),
                    Catch::Contains("fortran_order=True not supported"));
  CHECK_THROWS_WITH(npy::load(data_file("numpy_f4_bigendian_2.npy")), Catch::Contains("big-endian") &&
                                                                           Catch::Contains("'>f4'"));
}

TEST_CASE("npy: tolerant header syntax", "[npy]") {
  const std::string body = f4_body(6);
  for (const std::string& dict : {
           kDict23,
           std::string("{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}"),
           std::string("{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":(2,3)}"),
           std::string("  {  'descr' : '<f4' ,\t'fortran_order' : False , 'shape' : ( 2 , 3 , ) , }  "),
           std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }"),
       }) {
    INFO(dict);
    const npy::Array a = parse_str(make_npy(dict, body));
    CHECK(a.descr == "<f4");
    CHECK(a.shape == std::vector<std::int64_t>{2, 3});
  }
  CHECK(parse_str(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", body)).shape ==
        std::vector<std::int64_t>{6});
  CHECK(parse_str(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", f4_body(1))).shape.empty());
  // Byte-order spellings are canonicalised.
  CHECK(parse_str(make_npy("{'descr': '=f4', 'fortran_order': False, 'shape': (6,), }", body)).descr == "<f4");
  CHECK(parse_str(make_npy("{'descr': '<u1', 'fortran_order': False, 'shape': (2,), }", "ab")).descr == "|u1");
  CHECK(parse_str(make_npy("{'descr': '>u1', 'fortran_order': False, 'shape': (2,), }", "ab")).descr == "|u1");
  // Versions 2.0 and 3.0 (uint32 header length).
  CHECK(parse_str(make_npy(kDict23, body, 2)).shape == std::vector<std::int64_t>{2, 3});
  CHECK(parse_str(make_npy(kDict23, body, 3)).shape == std::vector<std::int64_t>{2, 3});
}

TEST_CASE("npy: as<T> checks the dtype", "[npy]") {
  const npy::Array a = parse_str(make_npy(kDict23, f4_body(6)));
  CHECK_NOTHROW(a.as<float>());
  CHECK_THROWS_AS(a.as<kvscore::half>(), npy::error);
  CHECK_THROWS_WITH(a.as<kvscore::half>(), Catch::Contains("'<f2'") && Catch::Contains("'<f4'"));
  CHECK_THROWS_WITH(a.to_vector<double>(), Catch::Contains("'<f8'") && Catch::Contains("'<f4'"));
  // A hand-built, inconsistent Array is caught too.
  npy::Array b = a;
  b.bytes.pop_back();
  CHECK_THROWS_WITH(b.as<float>(), Catch::Contains("needs 24 bytes, has 23"));
}

TEST_CASE("npy: error paths", "[npy]") {
  const std::string body = f4_body(6);
  const std::string good = make_npy(kDict23, body);
  REQUIRE_NOTHROW(parse_str(good));

  auto err = [](const std::string& bytes) -> std::string {
    try {
      parse_str(bytes);
    } catch (const npy::error& e) {
      return e.what();
    }
    return "<no error>";
  };
  auto dict_err = [&](const std::string& dict, const std::string& b = std::string(24, '\0')) {
    return err(make_npy(dict, b));
  };
  auto one_line = [](const std::string& m) { return m.find('\n') == std::string::npos; };

  SECTION("bad magic") {
    std::string s = good;
    s[1] = 'X';
    CHECK_THAT(err(s), Catch::StartsWith("mem: ") && Catch::Contains("bad magic"));
    CHECK_THAT(err(""), Catch::Contains("bad magic"));
    CHECK_THAT(err("\x93NUM"), Catch::Contains("bad magic"));
    CHECK_THAT(err("hello world, not numpy at all"), Catch::Contains("bad magic"));
  }
  SECTION("bad version") {
    std::string s = good;
    s[6] = 4;
    CHECK_THAT(err(s), Catch::Contains("version 4.0"));
    s[6] = 1;
    s[7] = 1;
    CHECK_THAT(err(s), Catch::Contains("version 1.1"));
  }
  SECTION("truncated header") {
    CHECK_THAT(err(good.substr(0, 7)), Catch::Contains("truncated header"));
    CHECK_THAT(err(good.substr(0, 9)), Catch::Contains("truncated header"));
    CHECK_THAT(err(good.substr(0, 50)), Catch::Contains("truncated header") && Catch::Contains("118"));
    const std::string v2 = make_npy(kDict23, body, 2);
    CHECK_THAT(err(v2.substr(0, 11)), Catch::Contains("truncated header"));
    // A huge declared length must not be trusted.
    std::string s = v2;
    s[8] = s[9] = s[10] = s[11] = char(0xff);
    CHECK_THAT(err(s), Catch::Contains("truncated header") && Catch::Contains("4294967295"));
  }
  SECTION("truncated data") {
    CHECK(err(good.substr(0, good.size() - 4)) == "mem: truncated: expected 24 data bytes, got 20");
    CHECK(err(good.substr(0, 128)) == "mem: truncated: expected 24 data bytes, got 0");
  }
  SECTION("extra data") {
    CHECK(err(good + "x") == "mem: trailing data: expected 24 data bytes, got 25");
  }
  SECTION("fortran order") {
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }"),
               Catch::Contains("fortran_order=True not supported"));
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': maybe, 'shape': (2, 3), }"),
               Catch::Contains("fortran_order must be True or False") && Catch::Contains("'maybe"));
  }
  SECTION("dtypes") {
    CHECK_THAT(dict_err("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }"),
               Catch::Contains("big-endian") && Catch::Contains("'>f4'"));
    CHECK_THAT(dict_err("{'descr': '>i8', 'fortran_order': False, 'shape': (3,), }"), Catch::Contains("'>i8'"));
    CHECK_THAT(dict_err("{'descr': '<U4', 'fortran_order': False, 'shape': (6,), }"),
               Catch::Contains("unsupported dtype descr '<U4'"));
    CHECK_THAT(dict_err("{'descr': '<f3', 'fortran_order': False, 'shape': (6,), }"), Catch::Contains("'<f3'"));
    CHECK_THAT(dict_err("{'descr': 'float32', 'fortran_order': False, 'shape': (6,), }"),
               Catch::Contains("'float32'"));
    CHECK_THAT(dict_err("{'descr': '|f4', 'fortran_order': False, 'shape': (6,), }"), Catch::Contains("'|f4'"));
    CHECK_THAT(dict_err("{'descr': '', 'fortran_order': False, 'shape': (6,), }"), Catch::Contains("''"));
    CHECK_THAT(dict_err("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }"),
               Catch::Contains("structured"));
  }
  SECTION("bad shape tokens") {
    for (const char* shape : {"(2, x)", "(2.0, 3)", "(2 3)", "[2, 3]", "(2, 3", "(,)", "(2,,3)", "2, 3", "(0x2, 3)",
                              "(2, 3))", "(-, 3)", "(2e1,)"}) {
      INFO(shape);
      const std::string m = dict_err(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + "}");
      CHECK(m != "<no error>");
      CHECK(one_line(m));
    }
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }"),
               Catch::Contains("bad shape token 'x"));
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': 6, }"),
               Catch::Contains("shape must be a tuple, got '6"));
  }
  SECTION("negative dim") {
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }"),
               Catch::Contains("negative dimension -3"));
  }
  SECTION("overflow") {
    // 2**62 * 2**62 overflows int64 elements.
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, "
                        "4611686018427387904), }"),
               Catch::Contains("overflows"));
    // 2**62 elements fit, but times 4 bytes do not.
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904,), }"),
               Catch::Contains("overflows"));
    // A dimension that does not fit in int64 at all.
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }"),
               Catch::Contains("'99999999999999999999999' overflows int64"));
    // Zero times huge is fine (empty), wherever the zero is.
    CHECK(parse_str(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4611686018427387904), }", ""))
              .size() == 0);
    CHECK(parse_str(make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, "
                             "4611686018427387904, 0), }", ""))
              .size() == 0);
  }
  SECTION("keys") {
    CHECK_THAT(dict_err("{'descr': '<f4', 'shape': (2, 3), }"), Catch::Contains("no 'fortran_order'"));
    CHECK_THAT(dict_err("{'fortran_order': False, 'shape': (2, 3), }"), Catch::Contains("no 'descr'"));
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False}"), Catch::Contains("no 'shape'"));
    CHECK_THAT(dict_err("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"),
               Catch::Contains("duplicate"));
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}"),
               Catch::Contains("unknown header key 'extra'"));
    CHECK_THAT(dict_err("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} trailing"),
               Catch::Contains("after header"));
    CHECK_THAT(dict_err("'descr': '<f4'"), Catch::Contains("expected '{'"));
    CHECK_THAT(dict_err("{'descr: '<f4'}"), Catch::Contains("expected ':'"));
    CHECK_THAT(dict_err("{'descr"), Catch::Contains("unterminated"));
    CHECK_THAT(dict_err(""), Catch::Contains("expected '{'"));
  }
  SECTION("messages are one line even for hostile bytes") {
    CHECK(one_line(dict_err("{'descr': '<f\n4', 'fortran_order': False, 'shape': (2, 3), }")));
    CHECK(one_line(dict_err(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (\n\x01\xff)}"))));
  }
}

TEST_CASE("npy: every prefix and single-byte corruption of a valid file is handled", "[npy]") {
  const std::string good = make_npy(kDict23, f4_body(6));
  for (std::size_t n = 0; n < good.size(); ++n) {
    CHECK_THROWS_AS(npy::parse(good.data(), n, "p"), npy::error);
  }
  int accepted = 0;
  for (std::size_t i = 0; i < 128; ++i) {
    for (int v : {0x00, 0x20, 0x27, 0x29, 0x2c, 0x30, 0x39, 0x7b, 0x7d, 0xff}) {
      std::string s = good;
      s[i] = char(v);
      try {
        const npy::Array a = npy::parse(s.data(), s.size(), "p");
        CHECK(std::uint64_t(a.size()) * 4 <= s.size());
        ++accepted;
      } catch (const npy::error& e) {
        CHECK(std::string(e.what()).find('\n') == std::string::npos);
      }
    }
  }
  CHECK(accepted > 0);  // e.g. padding spaces replaced by spaces
}

TEST_CASE("npy: save errors", "[npy]") {
  const float v[6] = {};
  CHECK_THROWS_WITH(npy::save(temp_file("e.npy"), "<f4", {2, 3}, v, 20),
                    Catch::Contains("needs 24 bytes, got 20"));
  CHECK_THROWS_WITH(npy::save(temp_file("e.npy"), ">f4", {2, 3}, v, 24), Catch::Contains("'>f4'"));
  CHECK_THROWS_WITH(npy::save(temp_file("e.npy"), "<x9", {2, 3}, v, 24), Catch::Contains("'<x9'"));
  CHECK_THROWS_WITH(npy::save<float>(temp_file("e.npy"), {-1, 3}, v), Catch::Contains("negative dimension -1"));
  CHECK_THROWS_WITH(npy::save<float>((temp_dir() / "no_such_dir" / "x.npy").string(), {2, 3}, v),
                    Catch::Contains("cannot open for writing"));
  CHECK_THROWS_WITH(npy::load((temp_dir() / "missing.npy").string()), Catch::Contains("missing.npy: cannot open"));
  // '<u1' and '=f4' are accepted and written canonically.
  npy::save(temp_file("u1.npy"), "<u1", {2}, "ab", 2);
  CHECK(npy::load(temp_file("u1.npy")).descr == "|u1");
}
