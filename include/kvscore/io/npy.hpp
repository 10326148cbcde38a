// kvscore/io/npy.hpp — read and write NumPy .npy files (format versions 1.0, 2.0, 3.0).
//
// Only what kvscore needs: plain little-endian numeric dtypes in C order. The reader
// is written to be safe on arbitrary bytes: every length and offset is checked, sizes
// are overflow-checked, and every failure is an npy::error with a one-line message
// that names the offending value (prefixed with the `what` given to parse, e.g. the
// path). Nothing is allocated from an untrusted length before it has been checked
// against the bytes actually present.
//
// Format reference: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
#pragma once

#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvscore/core/dtype.hpp"

namespace kvscore::npy {

static_assert(std::endian::native == std::endian::little,
              "kvscore::npy assumes a little-endian host (array data is used in place)");

/// Every failure of the reader / writer (malformed file, I/O error, wrong dtype).
class error : public std::runtime_error {
 public:
  using runtime_error::runtime_error;
};

/// The NumPy descr string for T. bfloat16 travels as its raw uint16 bits ("<u2"),
/// since numpy has no bfloat16 dtype.
template <class T>
constexpr const char* descr_of() {
  if constexpr (std::is_same_v<T, float>) return "<f4";
  else if constexpr (std::is_same_v<T, double>) return "<f8";
  else if constexpr (std::is_same_v<T, kvscore::half>) return "<f2";
  else if constexpr (std::is_same_v<T, kvscore::bfloat16>) return "<u2";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "<i8";
  else if constexpr (std::is_same_v<T, std::uint64_t>) return "<u8";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "<i4";
  else if constexpr (std::is_same_v<T, std::uint32_t>) return "<u4";
  else if constexpr (std::is_same_v<T, std::int16_t>) return "<i2";
  else if constexpr (std::is_same_v<T, std::uint16_t>) return "<u2";
  else if constexpr (std::is_same_v<T, std::int8_t>) return "|i1";
  else if constexpr (std::is_same_v<T, std::uint8_t>) return "|u1";
  else static_assert(sizeof(T) == 0, "kvscore::npy::descr_of: unsupported element type");
}

namespace detail {

/// Printable, bounded rendering of untrusted text for error messages (stays one line).
inline std::string quote(std::string_view s, std::size_t max_len = 40) {
  std::string out = "'";
  std::size_t n = 0;
  for (char c : s) {
    if (n++ == max_len) { out += "..."; break; }
    const unsigned char u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && c != '\\' && c != '\'') {
      out += c;
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
    }
  }
  out += "'";
  return out;
}

struct DescrInfo {
  std::string canonical;  // '<' for multi-byte, '|' for single-byte types
  std::size_t itemsize;
};

/// Validates a simple numeric descr and returns its canonical form and item size.
/// Throws npy::error (message without prefix) for anything unsupported.
inline DescrInfo describe(std::string_view d) {
  auto bad = [&](const std::string& why) -> DescrInfo { throw error("unsupported dtype descr " + quote(d) + why); };
  if (d.size() < 3 || d.size() > 4) return bad("");
  const char order = d[0], kind = d[1];
  if (order != '<' && order != '>' && order != '|' && order != '=') return bad(" (byte order must be '<', '|' or '=')");
  std::size_t size = 0;
  for (char c : d.substr(2)) {
    if (c < '0' || c > '9') return bad("");
    size = size * 10 + std::size_t(c - '0');
  }
  bool ok = false;
  switch (kind) {
    case 'b': ok = size == 1; break;
    case 'i': case 'u': ok = size == 1 || size == 2 || size == 4 || size == 8; break;
    case 'f': ok = size == 2 || size == 4 || size == 8; break;
    case 'c': ok = size == 8 || size == 16; break;
    default: break;
  }
  if (!ok) return bad("");
  if (size > 1 && order == '>') throw error("big-endian dtype " + quote(d) + " not supported");
  if (size > 1 && order == '|') return bad(" (multi-byte type needs an explicit byte order)");
  DescrInfo info;
  info.canonical = std::string(1, size == 1 ? '|' : '<') + kind + std::to_string(size);
  info.itemsize = size;
  return info;
}

inline std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

inline std::int64_t checked_size(const std::vector<std::int64_t>& shape, std::size_t itemsize,
                                 std::uint64_t* nbytes) {
  bool empty = false;
  for (std::int64_t d : shape) {
    if (d < 0) throw error("negative dimension " + std::to_string(d));
    empty = empty || d == 0;
  }
  std::int64_t n = 1;
  if (empty) n = 0;  // (2**62, 2**62, 0) is a valid empty array, as in numpy
  else
    for (std::int64_t d : shape)
      if (__builtin_mul_overflow(n, d, &n)) throw error("shape " + shape_str(shape) + ": element count overflows int64");
  std::uint64_t b;
  if (__builtin_mul_overflow(std::uint64_t(n), std::uint64_t(itemsize), &b) ||
      b > std::uint64_t(std::numeric_limits<std::int64_t>::max()) ||
      b > std::uint64_t(std::numeric_limits<std::size_t>::max()))
    throw error("data size " + std::to_string(n) + " x " + std::to_string(itemsize) + " bytes overflows");
  *nbytes = b;
  return n;
}

/// Recursive-descent parser for the header: a Python dict literal with keys
/// 'descr' (str), 'fortran_order' (bool), 'shape' (tuple of ints).
class HeaderParser {
 public:
  explicit HeaderParser(std::string_view s) : s_(s) {}

  void parse(std::string* descr, bool* fortran, std::vector<std::int64_t>* shape) {
    bool have_descr = false, have_fortran = false, have_shape = false;
    ws();
    expect('{');
    for (;;) {
      ws();
      if (peek() == '}') { ++i_; break; }
      const std::string key = string_lit("header key");
      ws();
      expect(':');
      ws();
      if (key == "descr") {
        if (have_descr) fail("duplicate header key 'descr'");
        if (peek() == '[') fail("structured dtype descr (list) not supported");
        *descr = string_lit("descr value");
        have_descr = true;
      } else if (key == "fortran_order") {
        if (have_fortran) fail("duplicate header key 'fortran_order'");
        *fortran = bool_lit();
        have_fortran = true;
      } else if (key == "shape") {
        if (have_shape) fail("duplicate header key 'shape'");
        tuple(shape);
        have_shape = true;
      } else {
        fail("unknown header key " + quote(key));
      }
      ws();
      if (peek() == ',') { ++i_; continue; }
      if (peek() == '}') { ++i_; break; }
      fail("expected ',' or '}' in header at " + here());
    }
    ws();
    if (i_ != s_.size()) fail("unexpected text after header dict: " + here());
    if (!have_descr) fail("header has no 'descr'");
    if (!have_fortran) fail("header has no 'fortran_order'");
    if (!have_shape) fail("header has no 'shape'");
  }

 private:
  [[noreturn]] static void fail(const std::string& m) { throw error(m); }

  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  bool at_end() const { return i_ >= s_.size(); }
  std::string here() const {
    if (at_end()) return "end of header";
    return quote(s_.substr(i_, 20));
  }
  void ws() {
    while (!at_end() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    if (peek() != c || at_end()) fail(std::string("expected '") + c + "' in header at " + here());
    ++i_;
  }
  std::string string_lit(const char* what) {
    const char q = peek();
    if (at_end() || (q != '\'' && q != '"')) fail(std::string("expected a quoted ") + what + " at " + here());
    const std::size_t start = ++i_;
    while (!at_end() && s_[i_] != q) {
      if (s_[i_] == '\\') fail(std::string("escape sequence in ") + what + " not supported");
      ++i_;
    }
    if (at_end()) fail(std::string("unterminated ") + what + " string " + quote(s_.substr(start - 1)));
    std::string out(s_.substr(start, i_ - start));
    ++i_;
    return out;
  }
  bool bool_lit() {
    if (s_.substr(i_, 4) == "True") { i_ += 4; return true; }
    if (s_.substr(i_, 5) == "False") { i_ += 5; return false; }
    fail("fortran_order must be True or False, got " + here());
  }
  void tuple(std::vector<std::int64_t>* shape) {
    shape->clear();
    if (peek() != '(') fail("shape must be a tuple, got " + here());
    ++i_;
    for (;;) {
      ws();
      if (peek() == ')' && !at_end()) { ++i_; return; }
      shape->push_back(integer());
      if (shape->size() > 64) fail("shape has more than 64 dimensions");
      ws();
      if (peek() == ',' && !at_end()) { ++i_; continue; }
      if (peek() == ')' && !at_end()) {
        ++i_;
        return;
      }
      fail("bad shape token " + here());
    }
  }
  std::int64_t integer() {
    const std::size_t start = i_;
    bool neg = false;
    if (peek() == '-' || peek() == '+') { neg = peek() == '-'; ++i_; }
    const std::size_t digits = i_;
    std::uint64_t v = 0;
    bool overflow = false;
    while (!at_end() && s_[i_] >= '0' && s_[i_] <= '9') {
      if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, std::uint64_t(s_[i_] - '0'), &v))
        overflow = true;
      ++i_;
    }
    if (i_ == digits) fail("bad shape token " + quote(s_.substr(start, 20)));
    if (!at_end() && (s_[i_] == 'L' || s_[i_] == 'l')) ++i_;  // Python 2 long suffix
    const std::string_view tok = s_.substr(start, i_ - start);
    if (!at_end() && s_[i_] != ',' && s_[i_] != ')' && s_[i_] != ' ' && s_[i_] != '\t' && s_[i_] != '\n' &&
        s_[i_] != '\r')
      fail("bad shape token " + quote(s_.substr(start, 20)));
    if (overflow || v > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
      fail("shape dimension " + quote(tok) + " overflows int64");
    if (neg && v != 0) fail("negative dimension " + std::string(tok) + " in shape");
    return std::int64_t(v);
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

inline std::string prefixed(const std::string& what, const std::string& msg) {
  return what.empty() ? msg : what + ": " + msg;
}

}  // namespace detail

/// A loaded array: dtype descr (canonical: "<f4", "|u1", ...), shape and raw C-order bytes.
struct Array {
  std::string descr;  ///< the dtype descr, canonical ("<f4", "<f2", "<u2", ...)
  std::vector<std::int64_t> shape;  ///< the shape, C order
  std::vector<unsigned char> bytes;  ///< the data, raw little-endian C-order bytes

  /// Number of elements: product of shape (1 for a 0-d array).
  std::int64_t size() const {
    for (std::int64_t d : shape)
      if (d == 0) return 0;
    std::int64_t n = 1;
    for (std::int64_t d : shape) __builtin_mul_overflow(n, d, &n);  // cannot overflow for parsed arrays
    return n;
  }

  /// Typed pointer to the data; throws npy::error unless descr is descr_of<T>().
  template <class T>
  const T* as() const {
    check<T>();
    return reinterpret_cast<const T*>(bytes.data());
  }

  /// Copy of the data as a vector<T>; same check as as<T>().
  template <class T>
  std::vector<T> to_vector() const {
    check<T>();
    std::vector<T> out(bytes.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }

 private:
  template <class T>
  void check() const {
    static_assert(std::is_trivially_copyable_v<T>);
    if (descr != descr_of<T>())
      throw error("npy: expected dtype '" + std::string(descr_of<T>()) + "', got " + detail::quote(descr));
    std::uint64_t nbytes = 0;
    try {
      detail::checked_size(shape, sizeof(T), &nbytes);
    } catch (const error& e) {
      throw error(std::string("npy: ") + e.what());
    }
    if (nbytes != bytes.size())
      throw error("npy: array of shape " + detail::shape_str(shape) + " needs " + std::to_string(nbytes) +
                  " bytes, has " + std::to_string(bytes.size()));
  }
};

/// The kvscore element type of `a` ('<f4' float32, '<f2' float16, '<u2' bfloat16 bits), for
/// kvscore::visit_dtype; any other dtype is std::invalid_argument "<what> dtype '<descr>' not
/// supported (...)".
inline kvscore::dtype element_dtype(const Array& a, const std::string& what) {
  if (a.descr == descr_of<float>()) return kvscore::dtype::f32;
  if (a.descr == descr_of<kvscore::half>()) return kvscore::dtype::f16;
  if (a.descr == descr_of<kvscore::bfloat16>()) return kvscore::dtype::bf16;
  throw std::invalid_argument(what + " dtype '" + a.descr +
                              "' not supported (expected '<f4' float32, '<f2' float16 or '<u2' bfloat16 bits)");
}

/// Parses a complete .npy image. `what` (e.g. the path) prefixes error messages.
inline Array parse(const void* data, std::size_t size, const std::string& what) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  auto fail = [&](const std::string& m) -> Array { throw error(detail::prefixed(what, m)); };
  if (p == nullptr && size != 0) return fail("null data");
  static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (size < 6 || std::memcmp(p, magic, 6) != 0) return fail("not a .npy file (bad magic)");
  if (size < 8) return fail("truncated header: file is " + std::to_string(size) + " bytes");
  const unsigned major = p[6], minor = p[7];
  std::size_t len_bytes;
  if (major == 1 && minor == 0) len_bytes = 2;
  else if ((major == 2 || major == 3) && minor == 0) len_bytes = 4;
  else return fail("unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor));
  const std::size_t pre = 8 + len_bytes;
  if (size < pre) return fail("truncated header: file is " + std::to_string(size) + " bytes");
  std::uint64_t header_len = 0;
  for (std::size_t i = 0; i < len_bytes; ++i) header_len |= std::uint64_t(p[8 + i]) << (8 * i);
  if (header_len > size - pre)
    return fail("truncated header: header length " + std::to_string(header_len) + " but only " +
                std::to_string(size - pre) + " bytes follow");
  const std::string_view header(reinterpret_cast<const char*>(p + pre), std::size_t(header_len));

  Array a;
  bool fortran = false;
  std::uint64_t nbytes = 0;
  try {
    detail::HeaderParser(header).parse(&a.descr, &fortran, &a.shape);
    if (fortran) throw error("fortran_order=True not supported");
    const detail::DescrInfo info = detail::describe(a.descr);
    a.descr = info.canonical;
    detail::checked_size(a.shape, info.itemsize, &nbytes);
  } catch (const error& e) {
    return fail(e.what());
  }
  const std::size_t avail = size - pre - std::size_t(header_len);
  if (avail < nbytes)
    return fail("truncated: expected " + std::to_string(nbytes) + " data bytes, got " + std::to_string(avail));
  if (avail > nbytes)
    return fail("trailing data: expected " + std::to_string(nbytes) + " data bytes, got " + std::to_string(avail));
  const unsigned char* body = p + pre + header_len;
  a.bytes.assign(body, body + nbytes);
  return a;
}

/// Reads and parses a .npy file.
inline Array load(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw error(path + ": cannot open: " + std::strerror(errno));
  std::vector<unsigned char> buf;
  unsigned char chunk[1 << 16];
  for (;;) {
    const std::size_t n = std::fread(chunk, 1, sizeof chunk, f);
    buf.insert(buf.end(), chunk, chunk + n);
    if (n < sizeof chunk) break;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw error(path + ": read error");
  return parse(buf.data(), buf.size(), path);
}

/// The complete header (magic through the newline) that save() writes.
inline std::string make_header(const std::string& descr, const std::vector<std::int64_t>& shape) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + detail::shape_str(shape) + ", }";
  // Pad with spaces so that magic + version + length + dict + '\n' is a multiple of 64.
  auto build = [&](unsigned major) {
    const std::size_t pre = major == 1 ? 10 : 12;
    const std::size_t unpadded = pre + dict.size() + 1;
    const std::size_t total = (unpadded + 63) / 64 * 64;
    const std::size_t hlen = total - pre;
    std::string h;
    h.reserve(total);
    h.append("\x93NUMPY", 6);
    h.push_back(char(major));
    h.push_back('\0');
    for (std::size_t i = 0; i < pre - 8; ++i) h.push_back(char((hlen >> (8 * i)) & 0xff));
    h += dict;
    h.append(total - h.size() - 1, ' ');
    h.push_back('\n');
    return h;
  };
  std::string h = build(1);
  if (h.size() - 10 > 0xffff) h = build(2);
  return h;
}

/// Writes a .npy file (format 1.0, or 2.0 if the header does not fit in 64 KiB).
/// `bytes` must equal the element count of `shape` times the item size of `descr`.
inline void save(const std::string& path, const std::string& descr, const std::vector<std::int64_t>& shape,
                 const void* data, std::size_t bytes) {
  std::uint64_t nbytes = 0;
  detail::DescrInfo info;
  try {
    info = detail::describe(descr);
    detail::checked_size(shape, info.itemsize, &nbytes);
  } catch (const error& e) {
    throw error(path + ": " + e.what());
  }
  // Spelling variants ('<u1', '=f4') are written in canonical form ('|u1', '<f4').
  if (nbytes != bytes)
    throw error(path + ": shape " + detail::shape_str(shape) + " of " + info.canonical + " needs " +
                std::to_string(nbytes) + " bytes, got " + std::to_string(bytes));
  if (data == nullptr && bytes != 0) throw error(path + ": data is null");
  const std::string header = make_header(info.canonical, shape);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw error(path + ": cannot open for writing: " + std::strerror(errno));
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size();
  if (ok && bytes != 0) ok = std::fwrite(data, 1, bytes, f) == bytes;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) throw error(path + ": write error");
}

/// Typed convenience: descr from descr_of<T>(), byte count from the shape.
template <class T>
void save(const std::string& path, const std::vector<std::int64_t>& shape, const T* data) {
  std::uint64_t nbytes = 0;
  try {
    detail::checked_size(shape, sizeof(T), &nbytes);
  } catch (const error& e) {
    throw error(path + ": " + e.what());
  }
  save(path, descr_of<T>(), shape, data, std::size_t(nbytes));
}

}  // namespace kvscore::npy
