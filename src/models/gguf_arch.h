// Internal to src/models: what gguf_checkpoint.cpp shares with the architecture files that map their
// own llama.cpp GGUF layout (nemotron_h.cpp, kimi_linear.cpp), so that an architecture's metadata
// keys and tensor names live beside its layers, as its config.json fields do (config_fields.h).
// Reading (GgufKeys, Source) and writing (GgufKeyWriter, Source::stored: `hypic quantize`) share them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "models/config.h"

namespace hypic::gguf_detail {

// Where a Hugging Face tensor comes from in the file, and what undoes the converter's change.
struct Source {
  std::string tensor;
  int64_t expert = -1;  // a slice of the stacked experts [E, rows, cols]
  // MinusOne: RMSNorm weights stored plus one. LogNeg: A_log stored as -exp(A_log).
  // Qkvz: Qwen3-Next's in_proj_qkvz, interleaved per key head again from the converter's q|k|v
  // (`tensor`) and z (`second`) halves.
  // RopeRows: q / k projections whose rows the converter permuted per head of `hd` rows as for
  // llama.cpp's RoPE (rows 2i + j of a head hold Hugging Face's rows j * hd / 2 + i).
  // MlaKvB: MLA's kv_b_proj [heads * (dk + dv), rank] from the converter's k_b [heads, rank, dk]
  // (`tensor`, transposed per head) and v_b [heads, dv, rank] (`second`).
  enum class Fix { None, MinusOne, LogNeg, Qkvz, RopeRows, MlaKvB } fix = Fix::None;
  int axis = -1;             // value heads regrouped along rows (0) or columns (1)
  int64_t from = 0, hd = 0;  // from this index, in blocks of hd (RopeRows: rows per head)
  std::string second{};      // Qkvz: the z half; MlaKvB: v_b
  // The same values in another shape (Mamba2's grouped norm, stored [groups, I / groups]).
  bool reshape = false;
  // Writing: the shape the converter stores (row-major) where it is not the model's; empty: the
  // model's (conv1d [C, 1, K] as [C, K] either way).
  std::vector<int64_t> stored{};
};

// "PREFIX.layers.N.rest" as ("blk.N.", rest); nullopt when the name is not a layer's.
std::optional<std::pair<std::string, std::string>> gguf_layer_of(const std::string& name, const std::string& prefix);

// "PREFIX.E.rest" of a layer's stacked experts as (E, rest); nullopt when it is not one.
std::optional<std::pair<int64_t, std::string>> gguf_expert_of(const std::string& rest, const std::string& prefix);

// An architecture's metadata keys ("ARCH.key"), with errors naming the file and the key.
class GgufKeys {
 public:
  GgufKeys(const GgufFile& f, std::string arch) : f_(f), arch_(std::move(arch)) {}
  const GgufFile& file() const { return f_; }
  const std::string& arch() const { return arch_; }
  std::string key(const std::string& k) const { return arch_ + "." + k; }
  bool has(const std::string& k) const { return f_.has(key(k)); }
  [[noreturn]] void fail(const std::string& what) const;
  int64_t positive(const std::string& k) const;
  int64_t count_or(const std::string& k, int64_t dflt) const;  // non-negative; dflt when absent
  double number(const std::string& k) const;
  double number_or(const std::string& k, double dflt) const;
  bool flag_or(const std::string& k, bool dflt) const;
  // A per-layer count: one integer for every layer, or an array of n (llama.cpp's get_key_or_arr).
  std::vector<int64_t> per_layer(const std::string& k, int64_t n) const;
  // The one value the layers with a non-zero entry of a per-layer key share (0 when none has one).
  int64_t shared_nonzero(const std::string& k, const std::vector<int64_t>& v) const;

 private:
  const GgufFile& f_;
  std::string arch_;
};

// The writing side of GgufKeys: an architecture's metadata as llama.cpp's converter types it
// (scalars u32 / f32 / bool, per-layer counts as i32 arrays), with errors naming the file.
class GgufKeyWriter {
 public:
  GgufKeyWriter(GgufWriter& g, std::string arch, std::string path)
      : g_(g), arch_(std::move(arch)), path_(std::move(path)) {}
  const std::string& arch() const { return arch_; }
  std::string key(const std::string& k) const { return arch_ + "." + k; }
  [[noreturn]] void fail(const std::string& what) const;
  void u32(const std::string& k, int64_t v);  // fails naming the key outside [0, 2^32)
  void f32(const std::string& k, double v);
  void flag(const std::string& k, bool v);
  void i32s(const std::string& k, const std::vector<int64_t>& v);

 private:
  GgufWriter& g_;
  std::string arch_, path_;
};

}  // namespace hypic::gguf_detail
