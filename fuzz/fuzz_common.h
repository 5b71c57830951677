// Shared by the fuzz targets: the bundled model's files (read once per process) and a private
// scratch folder for targets that must go through a file.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace hypic::fuzz {

inline std::string model_file(const std::string& name) {
  return std::string(HYPIC_SOURCE_DIR) + "/models/default/" + name;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A folder of this process under the temp dir, made on first use.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("hypic-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace hypic::fuzz
