// A fresh temporary folder per test, removed afterwards; helpers to write raw files.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace hypic::testing {

class TmpDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "hypic_io_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (std::filesystem::path(dir_) / name).string(); }
  void write_file(const std::string& name, const std::string& bytes) const {
    std::ofstream out(path(name), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good());
  }
  // A safetensors file from a raw header string and data bytes (no validation).
  void write_raw_safetensors(const std::string& name, const std::string& header, const std::string& data,
                             uint64_t header_len_override = 0) const {
    uint64_t n = header_len_override ? header_len_override : header.size();
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_file(name, bytes + header + data);
  }
  std::string dir_;
};

// Runs fn, expects std::runtime_error, returns its message.
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::runtime_error";
  return "";
}

}  // namespace hypic::testing
