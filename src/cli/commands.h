#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace hypic::cli {
// The --model flag's help, one text for every command (GGUF architectures: models/gguf_checkpoint.h).
inline constexpr const char* kModelHelp =
    "Model folder (Hugging Face layout), or a GGUF file of llama.cpp (qwen35, qwen35moe, qwen3next, nemotron_h, "
    "nemotron_h_moe, kimi-linear)";
void register_generate(CLI::App& app);
void register_info(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_quantize(CLI::App& app);
void register_bench(CLI::App& app);
void register_eval(CLI::App& app);
void register_serve(CLI::App& app);
// Set by a command that failed; main returns it.
int exit_code();
void set_exit_code(int c);
// Runs fn, printing "error: <message>" and setting exit code 1 on exceptions.
void guarded(const std::function<void()>& fn);
std::vector<int32_t> parse_ids(const std::string& csv);
// Non-empty comma-separated items.
std::vector<std::string> split_csv(const std::string& s);
// Comma-separated integers >= min_value; errors name the flag and the bad item.
std::vector<int> parse_int_list(const std::string& csv, const std::string& flag, int min_value);
}  // namespace hypic::cli
