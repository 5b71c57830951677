// hypic: command-line front end. Each subcommand is a thin layer over the library.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend/cpu/blas_core.h"
#include "cli/commands.h"

int main(int argc, char** argv) {
  // OpenBLAS on a CPU it did not recognise (virtual machines): run again on the right kernels.
  hypic::cpu::reexec_for_openblas_core(argv);
  // Logs go to stderr: stdout carries results (JSON, generated text, SSE never mixes with logs).
  spdlog::set_default_logger(spdlog::stderr_color_mt("hypic"));
  CLI::App app{"hypic: inference and serving for hybrid-attention LLMs with position-independent caching"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "hypic 0.1.0");
  hypic::cli::register_generate(app);
  hypic::cli::register_info(app);
  hypic::cli::register_tokenize(app);
  hypic::cli::register_quantize(app);
  hypic::cli::register_bench(app);
  hypic::cli::register_eval(app);
  hypic::cli::register_serve(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return hypic::cli::exit_code();
}
