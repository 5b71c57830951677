// The GGUF reader against a file written by gguf-py, llama.cpp's own writer
// (tools/reference/make_gguf_fixtures.py), and against damaged files built here byte by byte.
#include "io/gguf.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include "test_tmpdir.h"

namespace hypic {
namespace {

using hypic::testing::error_of;
using ::testing::HasSubstr;

const std::string kSmall = std::string(HYPIC_TEST_DATA) + "/gguf/small.gguf";

int64_t as_int(const GgufValue& v) {
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return static_cast<int64_t>(*u);
  return std::get<int64_t>(v.v);
}

TEST(Gguf, ReadsMetadataWrittenByGgufPy) {
  GgufFile f(kSmall);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.get_string("general.architecture"), "qwen35");
  EXPECT_EQ(f.get_int("qwen35.block_count"), 2);
  EXPECT_EQ(f.get_int("test.u8"), 200);
  EXPECT_EQ(f.get_int("test.i8"), -100);
  EXPECT_EQ(f.get_int("test.u16"), 60000);
  EXPECT_EQ(f.get_int("test.i16"), -30000);
  EXPECT_EQ(f.get_int("test.u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("test.i32"), -2000000000LL);
  EXPECT_EQ(f.get_int("test.u64"), int64_t(1) << 40);
  EXPECT_EQ(f.get_int("test.i64"), -(int64_t(1) << 40));
  EXPECT_EQ(f.get_float("test.f32"), 0.5);
  EXPECT_EQ(f.get_float("test.f64"), 0.25);
  EXPECT_EQ(f.metadata().at("test.bool").type, GgufType::Bool);
  EXPECT_TRUE(std::get<bool>(f.metadata().at("test.bool").v));
  EXPECT_EQ(f.get_string("test.string"), "h\xc3\xa9llo");
  const auto& toks = f.get_array("test.tokens");
  ASSERT_EQ(toks.elem, GgufType::String);
  ASSERT_EQ(toks.items.size(), 3u);
  EXPECT_EQ(std::get<std::string>(toks.items[2].v), "<|im_end|>");
  const auto& ints = f.get_array("test.ints");
  ASSERT_EQ(ints.items.size(), 3u);
  EXPECT_EQ(as_int(ints.items[0]), 1);
  EXPECT_EQ(as_int(ints.items[1]), -2);
  EXPECT_EQ(as_int(ints.items[2]), 3);
  // Errors name the key.
  EXPECT_THAT(error_of([&] { f.get_int("test.string"); }), HasSubstr("key test.string is string, expected an integer"));
  EXPECT_THAT(error_of([&] { f.get_string("no.such.key"); }), HasSubstr("missing key no.such.key"));
  EXPECT_THAT(error_of([&] { f.get_array("test.u8"); }), HasSubstr("key test.u8 is u8, expected an array"));
}

TEST(Gguf, ReadsTensorsWrittenByGgufPy) {
  GgufFile f(kSmall);
  ASSERT_EQ(f.tensors().size(), 4u);
  Tensor a = f.get("t.f32");
  ASSERT_EQ(a.shape(), (Shape{3, 4}));
  ASSERT_EQ(a.dtype(), DType::F32);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(a.data<float>()[i], static_cast<float>(i));
  Tensor h = f.get("t.f16").to_f32();
  ASSERT_EQ(h.shape(), (Shape{2, 8}));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(h.data<float>()[i], static_cast<float>(i) / 4);
  Tensor v = f.get("t.vec");
  ASSERT_EQ(v.shape(), (Shape{4}));
  EXPECT_EQ(v.data<float>()[1], -2.5f);

  // Q8_0: readable as bytes (blocks of an f16 scale and 32 int8), not as a float tensor.
  const GgufTensorInfo* q = f.find("t.q8_0");
  ASSERT_NE(q, nullptr);
  EXPECT_STREQ(q->type->name, "Q8_0");
  EXPECT_EQ(q->shape(), (Shape{2, 64}));
  EXPECT_EQ(q->bytes, 4u * 34u);
  const uint8_t* b = f.data(*q);
  for (int blk = 0; blk < 4; ++blk) {
    uint16_t hs;
    std::memcpy(&hs, b + blk * 34, 2);
    // f16 -> f32 of a normal positive scale
    const int e = (hs >> 10) & 31;
    const float d = std::ldexp(1.0f + static_cast<float>(hs & 1023) / 1024.0f, e - 15);
    for (int j = 0; j < 32; ++j) {
      const int i = blk * 32 + j;
      const float want = -1.0f + 2.0f * static_cast<float>(i) / 127.0f;  // np.linspace(-1, 1, 128)
      const float got = d * static_cast<float>(static_cast<int8_t>(b[blk * 34 + 2 + j]));
      EXPECT_NEAR(got, want, d) << "element " << i;
    }
  }
  // Read as a tensor, Q8_0 keeps its blocks (the CPU backend's products run on them).
  Tensor qt = f.get("t.q8_0");
  EXPECT_EQ(qt.dtype(), DType::Q8_0);
  EXPECT_EQ(qt.shape(), (Shape{2, 64}));
  EXPECT_EQ(qt.nbytes(), 4u * 34u);
  EXPECT_EQ(std::memcmp(qt.raw(), b, qt.nbytes()), 0);
  EXPECT_THAT(error_of([&] { f.get("t.none"); }), HasSubstr("missing tensor t.none"));
}

std::string read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class GgufDamage : public hypic::testing::TmpDirTest {};

// Every prefix of a valid file that cuts into its header or tensor data is refused with a message,
// never a crash or a hang; cutting only the writer's trailing padding leaves a valid file.
TEST_F(GgufDamage, EveryTruncationIsAnError) {
  const std::string whole = read_all(kSmall);
  ASSERT_GT(whole.size(), 100u);
  GgufFile full(kSmall);
  uint64_t need = full.data_offset();
  for (const auto& t : full.tensors()) need = std::max(need, full.data_offset() + t.offset + t.bytes);
  ASSERT_LE(need, whole.size());
  for (size_t n = 0; n < whole.size(); ++n) {
    write_file("t.gguf", whole.substr(0, n));
    if (n < need) {
      EXPECT_THAT(error_of([&] { GgufFile f(path("t.gguf")); }), HasSubstr("gguf ")) << "length " << n;
    } else {
      GgufFile f(path("t.gguf"));
      EXPECT_EQ(f.tensors().size(), full.tensors().size());
    }
  }
}

// Byte-level writer for damaged files.
struct Bytes {
  std::string s;
  template <typename T>
  Bytes& put(T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof v);
    return *this;
  }
  Bytes& str(const std::string& x) {
    put<uint64_t>(x.size());
    s += x;
    return *this;
  }
  Bytes& header(uint32_t version, uint64_t tensors, uint64_t kvs) {
    s += "GGUF";
    return put(version).put(tensors).put(kvs);
  }
  Bytes& pad(size_t to) {
    s.resize((s.size() + to - 1) / to * to, '\0');
    return *this;
  }
};

TEST_F(GgufDamage, DamagedHeadersNameTheProblem) {
  auto err = [&](const Bytes& b) {
    write_file("d.gguf", b.s);
    return error_of([&] { GgufFile f(path("d.gguf")); });
  };
  Bytes bad_magic;
  bad_magic.s = "GGML";
  bad_magic.put<uint32_t>(3).put<uint64_t>(0).put<uint64_t>(0);
  EXPECT_THAT(err(bad_magic), HasSubstr("bad magic"));
  EXPECT_THAT(err(Bytes().header(4, 0, 0)), HasSubstr("version 4 is not supported"));
  EXPECT_THAT(err(Bytes().header(3, 0, uint64_t(1) << 60)), HasSubstr("metadata count"));
  EXPECT_THAT(err(Bytes().header(3, uint64_t(1) << 60, 0)), HasSubstr("tensor count"));
  // A key whose length runs past the end.
  EXPECT_THAT(err(Bytes().header(3, 0, 1).put<uint64_t>(uint64_t(1) << 40).put<uint64_t>(0)), HasSubstr("truncated"));
  EXPECT_THAT(err(Bytes().header(3, 0, 1).str("k").put<uint32_t>(13).put<uint64_t>(0)),
              HasSubstr("key k: unknown value type 13"));
  EXPECT_THAT(err(Bytes().header(3, 0, 1).str("k").put<uint32_t>(7).put<uint8_t>(2).put<uint64_t>(0)),
              HasSubstr("key k: bool value 2"));
  // An array claiming more elements than the file holds is refused before anything is allocated.
  EXPECT_THAT(err(Bytes().header(3, 0, 1).str("a").put<uint32_t>(9).put<uint32_t>(5).put<uint64_t>(uint64_t(1) << 61)),
              HasSubstr("key a: array of"));
  EXPECT_THAT(err(Bytes()
                      .header(3, 0, 1)
                      .str("a")
                      .put<uint32_t>(9)
                      .put<uint32_t>(9)
                      .put<uint64_t>(1)
                      .put<uint32_t>(5)
                      .put<uint64_t>(0)),
              HasSubstr("arrays of arrays"));
  auto kv = [](Bytes b) { return b.str("x").put<uint32_t>(4).put<uint32_t>(1); };  // x = u32 1
  EXPECT_THAT(err(kv(kv(Bytes().header(3, 0, 2)))), HasSubstr("key x appears twice"));
  EXPECT_THAT(err(Bytes().header(3, 0, 1).str("general.alignment").put<uint32_t>(4).put<uint32_t>(24).put<uint64_t>(0)),
              HasSubstr("not a power of two"));

  // Tensor table problems, each naming the tensor.
  auto tensor = [](uint32_t nd, std::vector<uint64_t> ne, uint32_t type, uint64_t off) {
    Bytes b;
    b.header(3, 1, 0).str("w").put(nd);
    for (auto e : ne) b.put(e);
    b.put(type).put(off);
    return b;
  };
  EXPECT_THAT(err(tensor(5, {1, 1, 1, 1, 1}, 0, 0)), HasSubstr("tensor w: 5 dimensions"));
  EXPECT_THAT(err(tensor(1, {0}, 0, 0)), HasSubstr("tensor w: dimension 0 out of range"));
  EXPECT_THAT(err(tensor(1, {4}, 99, 0)), HasSubstr("tensor w: unknown ggml type 99"));
  EXPECT_THAT(err(tensor(1, {40}, 8, 0)), HasSubstr("not whole Q8_0 blocks"));
  // A known type hypic has no products for (Q4_0) opens, and reading it names the type.
  Bytes q4 = tensor(1, {32}, 2, 0);
  q4.pad(32).s += std::string(32, '\0');
  write_file("q4.gguf", q4.s);
  GgufFile q4f(path("q4.gguf"));
  EXPECT_THAT(error_of([&] { q4f.get("w"); }), HasSubstr("tensor w is Q4_0; hypic reads"));
  EXPECT_THAT(err(tensor(1, {4}, 0, 8)), HasSubstr("not a multiple of the alignment"));
  Bytes short_data = tensor(1, {16}, 0, 0);
  short_data.pad(32).s += std::string(32, '\0');  // 64 bytes needed
  EXPECT_THAT(err(short_data), HasSubstr("tensor w: data [0, 64) runs past the end"));
  Bytes overlap;
  overlap.header(3, 2, 0);
  for (const char* n : {"a", "b"}) overlap.str(n).put<uint32_t>(1).put<uint64_t>(16).put<uint32_t>(0).put<uint64_t>(0);
  overlap.pad(32).s += std::string(64, '\0');
  EXPECT_THAT(err(overlap), HasSubstr("tensors a and b overlap"));
}

TEST_F(GgufDamage, ARandomFileOrAFifoIsRefusedWithoutHanging) {
  write_file("r.gguf", std::string(100, 'x'));
  EXPECT_THAT(error_of([&] { GgufFile f(path("r.gguf")); }), HasSubstr("bad magic"));
  ASSERT_EQ(mkfifo(path("p.gguf").c_str(), 0600), 0);
  EXPECT_THAT(error_of([&] { GgufFile f(path("p.gguf")); }), HasSubstr("not a regular file"));
  EXPECT_THAT(error_of([&] { GgufFile f(path("missing.gguf")); }), HasSubstr("cannot open"));
}

}  // namespace
}  // namespace hypic
