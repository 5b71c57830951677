// llama.cpp's GGUF checkpoints of the architectures hypic runs (issue 17): files written by
// llama.cpp's convert_hf_to_gguf.py for `qwen35` (Qwen3.5 dense) and `qwen35moe` (Qwen3.5 MoE),
// read as a model: the config from the metadata, the weights mapped back onto the Hugging Face
// names and layouts the model code loads, and the tokenizer from the vocabulary.
//
// The converter changes some tensors on the way in; weights_from_gguf() undoes each:
//  - the decoder's RMSNorm weights (input / post-attention, q / k norms, final norm) are stored
//    plus one (llama.cpp multiplies by w, Qwen3.5 by 1 + w): minus one;
//  - A_log is stored as -exp(A_log): log(-a);
//  - with fewer key than value heads, a linear layer's value heads are stored in (repeat, key head)
//    order instead of (key head, repeat): in the v rows of in_proj_qkv, the rows of in_proj_z,
//    in_proj_b and in_proj_a, in A_log and dt_bias, the v channels of conv1d and the columns of
//    out_proj; they are put back (out_proj's columns, where a quantized block is wider than a head,
//    only through f32 in get(); get_with_col_order() keeps the blocks and names their heads);
//  - conv1d [C, 1, K] is stored [C, K]; the experts of a layer are stacked [E, I, H] (served as
//    per-expert views); a model with tied embeddings has no output.weight.
// Q8_0, Q4_K and Q6_K matrices stay quantized (products and embeddings on the CPU backend run on
// the blocks); quantized tensors of other ranks are dequantized at load. Qwen3-Next GGUFs (`qwen3next`) are read
// too: their linear layers keep each key head's value heads together (nothing to regroup), in_proj_qkvz is
// interleaved back from attn_qkv and attn_gate, and every layer's MLP is sparse (llama.cpp's converter cannot write
// mlp-only layers; the test file comes from an all-MoE derivative of the reference checkpoint).
// Nemotron-H (`nemotron_h`, `nemotron_h_moe`) and Kimi-Linear (`kimi-linear`) files are read too;
// their keys and tensor names are mapped beside their layers (nemotron_h.cpp, kimi_linear.cpp,
// through gguf_arch.h): Nemotron-H's q / k rows un-permuted (the converter applies llama.cpp's RoPE
// permutation though the model has no RoPE), A_log, D, conv1d and the grouped norm reshaped back;
// Kimi-Linear's kv_b_proj rebuilt from k_b (transposed per head) and v_b.
#pragma once
#include <memory>
#include <string>

#include "io/gguf.h"
#include "models/config.h"
#include "models/model.h"

namespace hypic {

// The config a GGUF's metadata describes. Throws naming the file and the missing or unsupported
// key (an architecture other than qwen35 / qwen35moe / qwen3next / nemotron_h / nemotron_h_moe /
// kimi-linear included).
ModelConfig gguf_model_config(const GgufFile& f);

// The file's tensors under the Hugging Face names and shapes the model code asks for. The file
// must outlive the source (float tensors that need no change are views of its mapping).
std::unique_ptr<WeightSource> weights_from_gguf(std::shared_ptr<const GgufFile> f, const ModelConfig& cfg);

// The file's tensor a Hugging Face name is read from (null when none): its storage type, shape.
const GgufTensorInfo* gguf_tensor_for(const GgufFile& f, const ModelConfig& cfg, const std::string& hf_name);

// tokenizer.json and tokenizer_config.json texts equivalent to the GGUF's tokenizer metadata
// (tokenizer.ggml.model "gpt2", pre-tokenizers "qwen2" and "qwen35"; the chat template, eos, bos
// and pad tokens). Throws naming the key when the tokenizer is absent or of another kind.
struct TokenizerTexts {
  std::string tokenizer_json, config_json;
};
TokenizerTexts gguf_tokenizer_texts(const GgufFile& f);

// The inverse (`hypic quantize`): cfg and its weights (Hugging Face names, as the model loads
// them) written as a llama.cpp GGUF of architecture qwen35, qwen35moe, qwen3next, nemotron_h or
// nemotron_h_moe (Kimi-Linear is read, not written), every converter change above applied in
// reverse. `type` is the matrices' type: BF16 or F16 (F32 keeps f32), or Q8_0,
// Q4_K, Q6_K with the rules of quantized_weights (routers kept, a Q4_K token embedding at Q6_K;
// rows that are not whole blocks in f16, as llama.cpp's converter does). Norms, A_log, D, dt_bias,
// conv1d and routers are written f32 as llama.cpp's converter writes them. `tokenizer` (may be null): the texts of
// tokenizer.json and tokenizer_config.json, written as tokenizer.ggml.* (byte-level BPE with the
// qwen2 or qwen35 pre-tokenizer; anything else throws naming it). Throws naming the tensor or key
// on anything the format or llama.cpp's loader cannot represent (e.g. full-attention layers that
// are not every n-th layer).
// q4_k_m (with type Q4_K): llama-quantize's Q4_K_M mix, Q6_K for the value and down projections
// of the layers it gives more bits (tensor types as its file has them; the blocks come from our
// quantizer, not byte-equal to ggml's K-quant search).
void write_gguf_checkpoint(const ModelConfig& cfg, const WeightSource& w, const TokenizerTexts* tokenizer, DType type,
                           const std::string& path, bool q4_k_m = false);

}  // namespace hypic
