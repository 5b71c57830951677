// The GGUF writer against the reader: every value type, every tensor type it writes, a file written
// by gguf-py rewritten value for value and byte for byte of its tensors, and its errors.
#include "io/gguf_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <type_traits>
#include <variant>

#include "gguf_values.h"
#include "io/gguf.h"
#include "tensor/quant.h"
#include "test_tmpdir.h"

namespace hypic {
namespace {

using ::testing::HasSubstr;

// fn's exception message (bad arguments are std::invalid_argument, I/O errors std::runtime_error).
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

const std::string kSmall = std::string(HYPIC_TEST_DATA) + "/gguf/small.gguf";

using hypic::testing::same_value;

Tensor quantized(DType dt, Shape shape, std::mt19937& rng) {
  Tensor f = Tensor::empty(DType::F32, shape);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] = nd(rng);
  Tensor q = Tensor::empty(dt, shape);
  quant::quantize(dt, f.data<float>(), f.numel(), q.raw());
  return q;
}

class GgufWriterTest : public hypic::testing::TmpDirTest {};

TEST_F(GgufWriterTest, EveryValueAndTensorTypeReadsBack) {
  GgufWriter w;
  w.set_string("general.architecture", "qwen35");
  w.set("t.u8", {GgufType::U8, uint64_t{200}});
  w.set("t.i8", {GgufType::I8, int64_t{-100}});
  w.set("t.u16", {GgufType::U16, uint64_t{60000}});
  w.set("t.i16", {GgufType::I16, int64_t{-30000}});
  w.set_u32("t.u32", 4000000000u);
  w.set_i32("t.i32", -2000000000);
  w.set_u64("t.u64", uint64_t(1) << 40);
  w.set("t.i64", {GgufType::I64, -(int64_t(1) << 40)});
  w.set_f32("t.f32", 0.5f);
  w.set("t.f64", {GgufType::F64, 0.25});
  w.set_bool("t.bool", true);
  w.set_string("t.string", "h\xc3\xa9llo");
  w.set_strings("t.tokens", {"a", "", "<|im_end|>"});
  w.set_i32s("t.ints", {1, -2, 3});
  w.set_u32("t.u32", 7);  // replaces the earlier value, in its place
  std::mt19937 rng(5);
  Tensor f32 = Tensor::empty(DType::F32, {3, 4}), bf = Tensor::empty(DType::BF16, {2, 8});
  for (int i = 0; i < 12; ++i) f32.data<float>()[i] = static_cast<float>(i) - 3.5f;
  for (int i = 0; i < 16; ++i) bf.data<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);  // 1.0, 1.0078, ...
  const std::vector<std::pair<std::string, Tensor>> ts = {{"t.f32", f32},
                                                          {"t.bf16", bf},
                                                          {"t.q8_0", quantized(DType::Q8_0, {2, 64}, rng)},
                                                          {"t.q4_k", quantized(DType::Q4_K, {3, 256}, rng)},
                                                          {"t.q6_k", quantized(DType::Q6_K, {2, 2, 256}, rng)},
                                                          {"t.vec", f32.reshape({12})}};
  for (const auto& [n, t] : ts) w.add_tensor(n, t);
  const std::string p = path("out.gguf");
  w.write(p);
  EXPECT_FALSE(std::filesystem::exists(p + ".tmp"));

  GgufFile f(p);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "qwen35");
  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -100);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -30000);
  EXPECT_EQ(f.get_int("t.u32"), 7);
  EXPECT_EQ(f.metadata().at("t.u32").type, GgufType::U32);
  EXPECT_EQ(f.get_int("t.i32"), -2000000000);
  EXPECT_EQ(f.get_int("t.u64"), int64_t(1) << 40);
  EXPECT_EQ(f.get_int("t.i64"), -(int64_t(1) << 40));
  EXPECT_EQ(f.get_float("t.f32"), 0.5);
  EXPECT_EQ(f.get_float("t.f64"), 0.25);
  EXPECT_TRUE(std::get<bool>(f.metadata().at("t.bool").v));
  EXPECT_EQ(f.get_string("t.string"), "h\xc3\xa9llo");
  const auto& toks = f.get_array("t.tokens");
  ASSERT_EQ(toks.items.size(), 3u);
  EXPECT_EQ(std::get<std::string>(toks.items[1].v), "");
  EXPECT_EQ(std::get<std::string>(toks.items[2].v), "<|im_end|>");
  EXPECT_EQ(std::get<int64_t>(f.get_array("t.ints").items[1].v), -2);
  ASSERT_EQ(f.tensors().size(), ts.size());
  for (const auto& [n, t] : ts) {
    const GgufTensorInfo* info = f.find(n);
    ASSERT_NE(info, nullptr) << n;
    EXPECT_EQ(info->shape(), t.shape()) << n;
    EXPECT_EQ(info->offset % f.alignment(), 0u) << n;
    ASSERT_EQ(info->bytes, t.nbytes()) << n;
    EXPECT_EQ(std::memcmp(f.data(*info), t.raw(), t.nbytes()), 0) << n;
  }
  Tensor q = f.get("t.q4_k");
  EXPECT_EQ(q.dtype(), DType::Q4_K);
}

// small.gguf was written by gguf-py (llama.cpp's own writer): every key and tensor survives a
// rewrite by ours.
TEST_F(GgufWriterTest, RewritesAFileWrittenByGgufPy) {
  GgufFile src(kSmall);
  GgufWriter w;
  for (const auto& [k, v] : src.metadata()) w.set(k, v);
  for (const auto& t : src.tensors()) {
    Tensor x = std::string(t.type->name) == "Q8_0"
                   ? Tensor::borrow(const_cast<uint8_t*>(src.data(t)), DType::Q8_0, t.shape())
                   : src.get(t.name);
    w.add_tensor(t.name, x);
  }
  const std::string p = path("rewritten.gguf");
  w.write(p);
  GgufFile f(p);
  ASSERT_EQ(f.metadata().size(), src.metadata().size());
  for (const auto& [k, v] : src.metadata()) {
    ASSERT_TRUE(f.has(k)) << k;
    EXPECT_TRUE(same_value(f.metadata().at(k), v)) << k;
  }
  ASSERT_EQ(f.tensors().size(), src.tensors().size());
  for (const auto& t : src.tensors()) {
    const GgufTensorInfo* g = f.find(t.name);
    ASSERT_NE(g, nullptr) << t.name;
    EXPECT_EQ(g->ne, t.ne) << t.name;
    EXPECT_EQ(g->type, t.type) << t.name;
    ASSERT_EQ(g->bytes, t.bytes) << t.name;
    EXPECT_EQ(std::memcmp(f.data(*g), src.data(t), t.bytes), 0) << t.name;
  }
}

TEST_F(GgufWriterTest, BadInputIsRefusedByName) {
  GgufWriter w;
  Tensor t = Tensor::empty(DType::F32, {2, 4});
  w.add_tensor("a", t);
  EXPECT_THAT(error_of([&] { w.add_tensor("a", t); }), HasSubstr("tensor a added twice"));
  EXPECT_THAT(error_of([&] { w.add_tensor("i", Tensor::empty(DType::I32, {4})); }), HasSubstr("tensor i is i32"));
  EXPECT_THAT(error_of([&] {
                w.add_tensor("d5", Tensor::empty(DType::F32, {1, 1, 1, 1, 2}));
              }),
              HasSubstr("tensor d5"));
  GgufArray mixed{GgufType::U8, {{GgufType::U8, uint64_t{1}}, {GgufType::I8, int64_t{1}}}};
  EXPECT_THAT(error_of([&] { w.set("m", {GgufType::Array, mixed}); }), HasSubstr("key m"));
  EXPECT_THAT(error_of([&] { w.set("s", {GgufType::String, uint64_t{3}}); }), HasSubstr("key s"));
  // The reader refuses arrays of arrays, so the writer does not make them.
  GgufArray nested{GgufType::Array, {}};
  nested.items.push_back({GgufType::Array, GgufArray{GgufType::U8, {{GgufType::U8, uint64_t{1}}}}});
  EXPECT_THAT(error_of([&] { w.set("n", {GgufType::Array, nested}); }), HasSubstr("key n"));
  w.set_u32("general.alignment", 12);
  EXPECT_THAT(error_of([&] { w.write(path("x.gguf")); }), HasSubstr("general.alignment"));
  w.set_u32("general.alignment", 64);
  const std::string bad = path("no/such/dir/x.gguf");
  EXPECT_THAT(error_of([&] { w.write(bad); }), HasSubstr("gguf " + bad));
  w.write(path("x.gguf"));
  GgufFile f(path("x.gguf"));
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
}

}  // namespace
}  // namespace hypic
