#include "io/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "test_tmpdir.h"

namespace hypic {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

using hypic::testing::error_of;

template <typename T>
Tensor make(DType dt, Shape shape, T start) {
  Tensor t = Tensor::empty(dt, std::move(shape));
  T* p = t.data<T>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<T>(start + static_cast<T>(i));
  return t;
}

Tensor make_f32(Shape shape, float start = 0.f) {
  return make<float>(DType::F32, std::move(shape), start);
}

std::string read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class SafetensorsTest : public testing::TmpDirTest {};

TEST_F(SafetensorsTest, RoundTripAllDtypes) {
  Tensor f32 = make_f32({2, 3}, 1.5f);
  Tensor f64 = make<double>(DType::F64, {4}, -2.25);
  Tensor i32 = make<int32_t>(DType::I32, {3, 1, 2}, -3);
  Tensor i64 = make<int64_t>(DType::I64, {2}, int64_t{1} << 40);
  Tensor u8 = make<uint8_t>(DType::U8, {5}, uint8_t{250});
  Tensor bf16 = Tensor::empty(DType::BF16, {3});
  Tensor f16 = Tensor::empty(DType::F16, {2, 2});
  float vals[4] = {1.0f, -0.5f, 3.25f, 65504.f};
  convert_from_f32(vals, DType::BF16, bf16.raw(), 3);
  convert_from_f32(vals, DType::F16, f16.raw(), 4);
  Tensor scalar = make_f32({}, 7.f);
  Tensor empty = make_f32({0, 3});

  std::vector<std::pair<std::string, Tensor>> in = {{"f32", f32}, {"f64", f64},       {"i32", i32},
                                                    {"i64", i64}, {"u8", u8},         {"bf16", bf16},
                                                    {"f16", f16}, {"scalar", scalar}, {"empty", empty}};
  write_safetensors(path("a.safetensors"), in, {{"format", "pt"}});

  SafetensorsFile f(path("a.safetensors"));
  EXPECT_EQ(f.path(), path("a.safetensors"));
  EXPECT_EQ(f.names(), (std::vector<std::string>{"bf16", "empty", "f16", "f32", "f64", "i32", "i64", "scalar", "u8"}));
  EXPECT_FALSE(f.has("__metadata__"));
  for (const auto& [name, want] : in) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.has(name));
    Tensor got = f.get(name);
    EXPECT_EQ(got.dtype(), want.dtype());
    EXPECT_EQ(got.shape(), want.shape());
    ASSERT_EQ(got.nbytes(), want.nbytes());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got.raw()) % dtype_size(got.dtype()), 0u) << "misaligned view";
    if (want.nbytes()) {
      EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0);
    }
  }
  Tensor b = f.get("bf16").to_f32();
  EXPECT_FLOAT_EQ(b.data<float>()[2], 3.25f);
  Tensor h = f.get("f16").to_f32();
  EXPECT_FLOAT_EQ(h.data<float>()[3], 65504.f);
  EXPECT_EQ(f.get("i64").data<int64_t>()[1], (int64_t{1} << 40) + 1);
  EXPECT_EQ(f.get("u8").data<uint8_t>()[4], uint8_t{254});
  EXPECT_EQ(f.get("scalar").numel(), 1);
  EXPECT_FLOAT_EQ(f.get("scalar").data<float>()[0], 7.f);
}

TEST_F(SafetensorsTest, HeaderIsPaddedWithSpacesAndParsesAsJson) {
  write_safetensors(path("a.safetensors"), {{"x", make_f32({3})}}, {{"format", "pt"}});
  std::string bytes = read_all(path("a.safetensors"));
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 12);
  std::string header = bytes.substr(8, n);
  auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["__metadata__"]["format"], "pt");
  EXPECT_EQ(j["x"]["dtype"], "F32");
  EXPECT_EQ(j["x"]["shape"], nlohmann::json::array({3}));
  EXPECT_EQ(j["x"]["data_offsets"], nlohmann::json::array({0, 12}));
  EXPECT_EQ(header.find_first_not_of(' ', header.rfind('}') + 1), std::string::npos);
  // Data section is 8-byte aligned in the mapping.
  SafetensorsFile f(path("a.safetensors"));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.get("x").raw()) % 8, 0u);
}

TEST_F(SafetensorsTest, TensorsKeepTheMappingAlive) {
  write_safetensors(path("a.safetensors"), {{"x", make_f32({1000}, 3.f)}});
  Tensor t;
  {
    SafetensorsFile f(path("a.safetensors"));
    t = f.get("x");
  }
  fs::remove(path("a.safetensors"));  // unlinking does not unmap
  EXPECT_FLOAT_EQ(t.data<float>()[999], 1002.f);
}

TEST_F(SafetensorsTest, MisalignedTensorsAreCopiedToAlignedMemory) {
  // u8[3] then f32[2] at byte 3: valid per the format, but a view would be misaligned.
  std::string data = {1, 2, 3};
  float v[2] = {1.5f, -2.f};
  data.append(reinterpret_cast<const char*>(v), 8);
  write_raw_safetensors("t.safetensors",
                        R"({"b": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                            "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}})",
                        data);
  SafetensorsFile f(path("t.safetensors"));
  Tensor t = f.get("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 4, 0u);
  EXPECT_FLOAT_EQ(t.data<float>()[0], 1.5f);
  EXPECT_FLOAT_EQ(t.data<float>()[1], -2.f);
  EXPECT_EQ(f.get("b").data<uint8_t>()[2], 3);
}

TEST_F(SafetensorsTest, WriteIsAtomicAndOverwrites) {
  write_safetensors(path("a.safetensors"), {{"x", make_f32({2})}});
  write_safetensors(path("a.safetensors"), {{"y", make_f32({4}, 1.f)}});
  SafetensorsFile f(path("a.safetensors"));
  EXPECT_FALSE(f.has("x"));
  EXPECT_EQ(f.get("y").shape(), Shape{4});
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "a.safetensors");  // no temp file left behind
  }
  EXPECT_EQ(entries, 1);
}

TEST_F(SafetensorsTest, WriteRejectsDuplicateNames) {
  EXPECT_THROW(write_safetensors(path("a.safetensors"), {{"x", make_f32({2})}, {"x", make_f32({2})}}),
               std::invalid_argument);
  EXPECT_FALSE(fs::exists(path("a.safetensors")));
  EXPECT_THROW(write_safetensors(path("a.safetensors"), {{"x", Tensor()}}), std::invalid_argument);
}

TEST_F(SafetensorsTest, WriteToMissingFolderFails) {
  std::string p = path("nope/a.safetensors");
  EXPECT_THAT(error_of([&] { write_safetensors(p, {{"x", make_f32({2})}}); }), HasSubstr(p));
}

// ---- malformed files: every message names the file ------------------------------------------

TEST_F(SafetensorsTest, MissingFile) {
  std::string p = path("missing.safetensors");
  EXPECT_THAT(error_of([&] { SafetensorsFile f(p); }), AllOf(HasSubstr(p), HasSubstr("cannot open")));
}

TEST_F(SafetensorsTest, ShorterThanEightBytes) {
  write_file("short.safetensors", "abc");
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("short.safetensors")); }),
              AllOf(HasSubstr(path("short.safetensors")), HasSubstr("3 bytes"), HasSubstr("shorter")));
  write_file("empty.safetensors", "");
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("empty.safetensors")); }),
              AllOf(HasSubstr(path("empty.safetensors")), HasSubstr("0 bytes")));
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  write_raw_safetensors("t.safetensors", "{}", "", 4096);
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("4096"), HasSubstr("past the end")));
}

TEST_F(SafetensorsTest, AbsurdHeaderLength) {
  write_raw_safetensors("t.safetensors", "{}", "", uint64_t{1} << 40);
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("absurd")));
  // Something that is not a safetensors file at all (e.g. a pickle) lands here too.
  write_file("t2.safetensors", std::string("\x80\x02}q\x00(X\x05\x00\x00\x00", 12));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t2.safetensors")); }), HasSubstr(path("t2.safetensors")));
}

TEST_F(SafetensorsTest, MalformedJson) {
  write_raw_safetensors("t.safetensors", R"({"x": {"dtype": "F32", )", "");
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("malformed JSON")));
  write_raw_safetensors("t2.safetensors", R"([1, 2])", "");
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t2.safetensors")); }),
              AllOf(HasSubstr(path("t2.safetensors")), HasSubstr("not an object")));
}

TEST_F(SafetensorsTest, EmptyHeaderIsValid) {
  write_raw_safetensors("t.safetensors", "{}      ", "");
  SafetensorsFile f(path("t.safetensors"));
  EXPECT_TRUE(f.names().empty());
}

TEST_F(SafetensorsTest, MissingFields) {
  struct Case {
    const char* header;
    const char* field;
  } cases[] = {
      {R"({"w.weight": {"shape": [2], "data_offsets": [0, 8]}})", "'dtype'"},
      {R"({"w.weight": {"dtype": "F32", "data_offsets": [0, 8]}})", "'shape'"},
      {R"({"w.weight": {"dtype": "F32", "shape": [2]}})", "'data_offsets'"},
      {R"({"w.weight": 3})", "not an object"},
      {R"({"w.weight": {"dtype": 1, "shape": [2], "data_offsets": [0, 8]}})", "'dtype'"},
      {R"({"w.weight": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", "'shape'"},
      {R"({"w.weight": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", "invalid dimension"},
      {R"({"w.weight": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", "invalid dimension"},
      {R"({"w.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}})", "'data_offsets'"},
      {R"({"w.weight": {"dtype": "F32", "shape": [2], "data_offsets": [-1, 7]}})", "'data_offsets'"},
      {R"({"w.weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", "end before begin"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    write_raw_safetensors("t.safetensors", c.header, std::string(16, '\0'));
    EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
                AllOf(HasSubstr(path("t.safetensors")), HasSubstr("'w.weight'"), HasSubstr(c.field)));
  }
}

TEST_F(SafetensorsTest, MetadataMustBeAnObject) {
  write_raw_safetensors("t.safetensors", R"({"__metadata__": [1]})", "");
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("__metadata__")));
}

TEST_F(SafetensorsTest, UnsupportedDtype) {
  for (const char* dt : {"F8_E4M3", "BOOL", "I8", "bogus"}) {
    SCOPED_TRACE(dt);
    std::string h = std::string(R"({"layers.0.w": {"dtype": ")") + dt + R"(", "shape": [4], "data_offsets": [0, 4]}})";
    write_raw_safetensors("t.safetensors", h, std::string(4, '\0'));
    EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
                AllOf(HasSubstr(path("t.safetensors")), HasSubstr("'layers.0.w'"),
                      HasSubstr("unsupported dtype '" + std::string(dt) + "'")));
  }
}

TEST_F(SafetensorsTest, OffsetsNotMatchingShape) {
  write_raw_safetensors("t.safetensors", R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}})",
                        std::string(24, '\0'));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("'w'"), HasSubstr("span 24 bytes"),
                    HasSubstr("needs 12 bytes")));
  // A shape whose byte size overflows 64 bits.
  write_raw_safetensors("t2.safetensors",
                        R"({"w": {"dtype": "F64", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})",
                        std::string(8, '\0'));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t2.safetensors")); }),
              AllOf(HasSubstr(path("t2.safetensors")), HasSubstr("'w'"), HasSubstr("overflow")));
}

TEST_F(SafetensorsTest, OffsetsOutsideTheFile) {
  // 16 bytes of data but the tensor claims [8, 24).
  write_raw_safetensors("t.safetensors", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                        std::string(16, '\0'));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("'w'"), HasSubstr("outside the file")));
  // Truncated by a single byte.
  write_raw_safetensors("t2.safetensors", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                        std::string(15, '\0'));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t2.safetensors")); }),
              AllOf(HasSubstr(path("t2.safetensors")), HasSubstr("outside the file")));
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  write_raw_safetensors("t.safetensors",
                        R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                            "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                        std::string(20, '\0'));
  EXPECT_THAT(error_of([&] { SafetensorsFile f(path("t.safetensors")); }),
              AllOf(HasSubstr(path("t.safetensors")), HasSubstr("'a'"), HasSubstr("'b'"), HasSubstr("overlap")));
  // Adjacent tensors and zero-sized tensors do not overlap.
  write_raw_safetensors("ok.safetensors",
                        R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                            "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
                            "b": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]}})",
                        std::string(20, '\0'));
  SafetensorsFile ok(path("ok.safetensors"));
  EXPECT_EQ(ok.names().size(), 3u);
}

TEST_F(SafetensorsTest, GetUnknownNameNamesFileAndTensor) {
  write_safetensors(path("a.safetensors"), {{"x", make_f32({2})}});
  SafetensorsFile f(path("a.safetensors"));
  EXPECT_THAT(error_of([&] { f.get("nope"); }), AllOf(HasSubstr(path("a.safetensors")), HasSubstr("'nope'")));
}

// ---- WeightStore --------------------------------------------------------------------------------

TEST_F(SafetensorsTest, StoreSingleFileAndShapeCheck) {
  write_safetensors(path("model.safetensors"),
                    {{"model.embed_tokens.weight", make_f32({4, 2})}, {"lm_head.weight", make_f32({4, 2}, 1.f)}});
  // Stray files next to model.safetensors are ignored.
  write_safetensors(path("other.safetensors"), {{"junk", make_f32({1})}});
  WeightStore ws(dir_);
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight"}));
  EXPECT_TRUE(ws.has("lm_head.weight"));
  EXPECT_FALSE(ws.has("junk"));
  EXPECT_EQ(ws.total_bytes(), 64u);
  EXPECT_EQ(ws.file_of("lm_head.weight"), path("model.safetensors"));
  Tensor t = ws.get("lm_head.weight", {4, 2});
  EXPECT_FLOAT_EQ(t.data<float>()[7], 8.f);
  EXPECT_EQ(ws.get("lm_head.weight").shape(), (Shape{4, 2}));  // no expectation: any shape

  EXPECT_THAT(error_of([&] {
                ws.get("lm_head.weight", {2, 4});
              }),
              AllOf(HasSubstr("tensor 'lm_head.weight' in " + path("model.safetensors")),
                    HasSubstr("expected shape [2, 4], found [4, 2]")));
}

TEST_F(SafetensorsTest, StoreMissingTensorSuggestsSimilarNames) {
  write_safetensors(path("model.safetensors"), {{"model.layers.0.mlp.down_proj.weight", make_f32({1})},
                                                {"model.layers.0.mlp.gate_proj.weight", make_f32({1})},
                                                {"model.layers.0.mlp.up_proj.weight", make_f32({1})},
                                                {"model.layers.0.self_attn.q_proj.weight", make_f32({1})},
                                                {"model.norm.weight", make_f32({1})}});
  WeightStore ws(dir_);
  std::string msg = error_of([&] { ws.get("model.layers.0.mlp.up_proj.bias"); });
  EXPECT_THAT(msg, AllOf(HasSubstr("missing tensor 'model.layers.0.mlp.up_proj.bias' in " + dir_),
                         HasSubstr("5 tensors"), HasSubstr("similar: 'model.layers.0.mlp.up_proj.weight')")));
  msg = error_of([&] { ws.get("model.layers.0.mlp.experts.gate_up_proj"); });
  EXPECT_THAT(msg, HasSubstr("similar: 'model.layers.0.mlp.down_proj.weight', 'model.layers.0.mlp.gate_proj.weight', "
                             "'model.layers.0.mlp.up_proj.weight'"));
  msg = error_of([&] { ws.get("zzz"); });
  EXPECT_THAT(msg, AllOf(HasSubstr("missing tensor 'zzz' in " + dir_), Not(HasSubstr("similar"))));
  EXPECT_THAT(error_of([&] { ws.file_of("zzz"); }), HasSubstr("missing tensor 'zzz'"));
}

TEST_F(SafetensorsTest, StoreShardedWithIndex) {
  write_safetensors(path("model-00001-of-00002.safetensors"), {{"a", make_f32({2})}, {"b", make_f32({3}, 10.f)}});
  write_safetensors(path("model-00002-of-00002.safetensors"), {{"c", make<int64_t>(DType::I64, {2}, int64_t{5})}});
  write_file("model.safetensors.index.json", R"({"metadata": {"total_size": 36}, "weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors"}})");
  WeightStore ws(dir_);
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(ws.file_of("b"), path("model-00001-of-00002.safetensors"));
  EXPECT_EQ(ws.file_of("c"), path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(ws.get("c", {2}).data<int64_t>()[1], 6);
  EXPECT_FLOAT_EQ(ws.get("b").data<float>()[2], 12.f);
  EXPECT_EQ(ws.total_bytes(), 36u);
  EXPECT_THAT(error_of([&] { ws.get("c", {3}); }),
              AllOf(HasSubstr(path("model-00002-of-00002.safetensors")), HasSubstr("expected shape [3], found [2]")));
}

TEST_F(SafetensorsTest, StoreIndexShardMissing) {
  write_safetensors(path("model-00001-of-00002.safetensors"), {{"a", make_f32({2})}});
  write_file("model.safetensors.index.json", R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
      "b": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }),
              AllOf(HasSubstr(path("model-00002-of-00002.safetensors")), HasSubstr("does not exist"),
                    HasSubstr("model.safetensors.index.json")));
}

TEST_F(SafetensorsTest, StoreIndexTensorAbsentFromShard) {
  write_safetensors(path("s1.safetensors"), {{"a", make_f32({2})}});
  write_file("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}})");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }),
              AllOf(HasSubstr("'ghost'"), HasSubstr(path("s1.safetensors")), HasSubstr("absent")));
}

TEST_F(SafetensorsTest, StoreIndexMalformed) {
  write_file("model.safetensors.index.json", R"({"weight_map": )");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }),
              AllOf(HasSubstr(path("model.safetensors.index.json")), HasSubstr("malformed JSON")));
  write_file("model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }),
              AllOf(HasSubstr(path("model.safetensors.index.json")), HasSubstr("'weight_map'")));
  write_file("model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }),
              AllOf(HasSubstr(path("model.safetensors.index.json")), HasSubstr("'a'")));
}

TEST_F(SafetensorsTest, StoreCorruptShardNamesTheShard) {
  write_file("s1.safetensors", "xx");
  write_file("model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors"}})");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }), HasSubstr(path("s1.safetensors")));
}

TEST_F(SafetensorsTest, StoreFallsBackToEverySafetensorsFileSorted) {
  write_safetensors(path("b.safetensors"), {{"y", make_f32({1})}});
  write_safetensors(path("a.safetensors"), {{"x", make_f32({1})}});
  write_file("notes.txt", "hello");
  WeightStore ws(dir_);
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(ws.file_of("x"), path("a.safetensors"));
  EXPECT_EQ(ws.file_of("y"), path("b.safetensors"));
}

TEST_F(SafetensorsTest, StoreDuplicateTensorAcrossFiles) {
  write_safetensors(path("a.safetensors"), {{"x", make_f32({1})}});
  write_safetensors(path("b.safetensors"), {{"x", make_f32({1})}});
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }),
              AllOf(HasSubstr("'x'"), HasSubstr(path("a.safetensors")), HasSubstr(path("b.safetensors"))));
}

TEST_F(SafetensorsTest, StoreWithoutWeights) {
  write_file("config.json", "{}");
  EXPECT_THAT(error_of([&] { WeightStore ws(dir_); }), HasSubstr("no safetensors weights in " + dir_));
  EXPECT_THAT(error_of([&] { WeightStore ws(path("absent")); }),
              AllOf(HasSubstr(path("absent")), HasSubstr("does not exist")));
  EXPECT_THAT(error_of([&] { WeightStore ws(path("config.json")); }),
              AllOf(HasSubstr(path("config.json")), HasSubstr("not a directory")));
}

}  // namespace
}  // namespace hypic
