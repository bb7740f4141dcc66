// Datasets: token files built from a real text, .npy files written here and by NumPy, and
// malformed .npy headers refused with the reason.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "train_testing.h"
#include "troupe/actors/dataset.h"

namespace troupe::actors {
namespace {

using testing::TempDir;

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void writeAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A .npy v1.0 file with `dict` as its header (padded as NumPy does) and `data` after it.
std::string npyWith(const std::string& dict, const std::string& data) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  return out + header + data;
}

TEST_CASE("a token file from a real text: windows of context + 1 bytes at i * context") {
  TempDir dir;
  const std::string text_path = testing::kEnglishText;
  const std::string text = readAll(text_path);
  REQUIRE(text.size() > 10000);
  for (const std::string type : {"uint16", "uint32"}) {
    CAPTURE(type);
    const std::string tokens = dir.path() + "/gpl3." + type;
    auto count = buildTokenFile(text_path, tokens, type);
    REQUIRE_MESSAGE(count.isOk(), count.status().toString());
    CHECK(*count == text.size());
    CHECK(std::filesystem::file_size(tokens) == text.size() * (type == "uint16" ? 2 : 4));
    auto dataset = openTokenDataset({tokens, type, 64});
    REQUIRE_MESSAGE(dataset.isOk(), dataset.status().toString());
    CHECK((*dataset)->size() == (text.size() - 1) / 64);
    auto batch = (*dataset)->batch({3, 0, (*dataset)->size() - 1});
    REQUIRE(batch.isOk());
    CHECK(batch->inputs.shape == std::vector<int64_t>{3, 64});
    CHECK(batch->targets.shape == std::vector<int64_t>{3, 64});
    CHECK(batch->inputs.dtype == "int64");
    const auto* in = reinterpret_cast<const int64_t*>(batch->inputs.bytes.data());
    const auto* out = reinterpret_cast<const int64_t*>(batch->targets.bytes.data());
    for (int j = 0; j < 64; ++j) {
      CHECK(in[j] == static_cast<uint8_t>(text[3 * 64 + j]));
      CHECK(out[j] == static_cast<uint8_t>(text[3 * 64 + j + 1]));
      CHECK(in[64 + j] == static_cast<uint8_t>(text[j]));
    }
    CHECK(batch->sample_ids == std::vector<uint64_t>{3, 0, (*dataset)->size() - 1});
    auto out_of_range = (*dataset)->batch({(*dataset)->size()});
    CHECK(out_of_range.status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("token files: wrong type, odd size, too short and missing files are refused") {
  TempDir dir;
  CHECK(openTokenDataset({dir.path() + "/none", "uint16", 8}).status().code() == StatusCode::kNotFound);
  writeAll(dir.path() + "/odd", std::string(11, 'a'));
  auto odd = openTokenDataset({dir.path() + "/odd", "uint16", 2});
  CHECK(odd.status().code() == StatusCode::kInvalidArgument);
  CHECK(odd.status().message().find("whole number") != std::string::npos);
  writeAll(dir.path() + "/short", std::string(8, 'a'));
  auto tiny = openTokenDataset({dir.path() + "/short", "uint16", 4});
  CHECK(tiny.status().message().find("context + 1") != std::string::npos);
  CHECK(openTokenDataset({dir.path() + "/short", "int8", 1}).status().code() == StatusCode::kInvalidArgument);
  CHECK(buildTokenFile(dir.path() + "/none", dir.path() + "/t", "uint16").status().code() ==
        StatusCode::kNotFound);
}

TEST_CASE(".npy: write, read back, and serve features with labels") {
  TempDir dir;
  HostTensor features;
  features.dtype = "float32";
  features.shape = {5, 3};
  features.bytes.resize(15 * 4);
  auto* f = reinterpret_cast<float*>(features.bytes.data());
  for (int i = 0; i < 15; ++i) f[i] = 0.5f * static_cast<float>(i);
  HostTensor labels;
  labels.dtype = "int64";
  labels.shape = {5};
  labels.bytes.resize(5 * 8);
  auto* l = reinterpret_cast<int64_t*>(labels.bytes.data());
  for (int i = 0; i < 5; ++i) l[i] = i % 2;
  REQUIRE(writeNpy(dir.path() + "/x.npy", features).isOk());
  REQUIRE(writeNpy(dir.path() + "/y.npy", labels).isOk());
  const std::string x = readAll(dir.path() + "/x.npy");
  CHECK(x.find("'shape': (5, 3)") != std::string::npos);
  CHECK(readAll(dir.path() + "/y.npy").find("'shape': (5,)") != std::string::npos);
  auto back = readNpy(dir.path() + "/x.npy");
  REQUIRE(back.isOk());
  CHECK(back->shape == features.shape);
  CHECK(back->bytes == features.bytes);
  auto dataset = openNpyDataset(dir.path() + "/x.npy", dir.path() + "/y.npy");
  REQUIRE_MESSAGE(dataset.isOk(), dataset.status().toString());
  CHECK((*dataset)->size() == 5);
  auto batch = (*dataset)->batch({4, 1});
  REQUIRE(batch.isOk());
  CHECK(batch->inputs.shape == std::vector<int64_t>{2, 3});
  CHECK(reinterpret_cast<const float*>(batch->inputs.bytes.data())[0] == 6.0f);
  CHECK(reinterpret_cast<const float*>(batch->inputs.bytes.data())[3] == 1.5f);
  CHECK(reinterpret_cast<const int64_t*>(batch->targets.bytes.data())[0] == 0);
  CHECK(reinterpret_cast<const int64_t*>(batch->targets.bytes.data())[1] == 1);
  // Row counts must agree.
  labels.shape = {4};
  labels.bytes.resize(4 * 8);
  REQUIRE(writeNpy(dir.path() + "/y4.npy", labels).isOk());
  CHECK(openNpyDataset(dir.path() + "/x.npy", dir.path() + "/y4.npy").status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE(".npy files written by NumPy are read (skipped without python3-numpy)") {
  TempDir dir;
  const std::string path = dir.path() + "/np.npy";
  const std::string script =
      "import sys, numpy as np\n"
      "np.save(sys.argv[1], np.arange(12, dtype=np.float32).reshape(3, 4) * 0.25)\n"
      "np.save(sys.argv[1] + '.i8.npy', np.array([7, -1, 3], dtype=np.int64))\n"
      "np.save(sys.argv[1] + '.f.npy', np.asfortranarray(np.ones((2, 3), dtype=np.float32)))\n";
  if (!testing::pythonHas("numpy")) {
    MESSAGE("skipped: " << testing::python() << " cannot import numpy (install python3-numpy)");
    return;
  }
  const std::string failure = testing::runPython(dir.path(), script, {path});
  REQUIRE_MESSAGE(failure.empty(), failure);
  auto a = readNpy(path);
  REQUIRE_MESSAGE(a.isOk(), a.status().toString());
  CHECK(a->dtype == "float32");
  CHECK(a->shape == std::vector<int64_t>{3, 4});
  CHECK(reinterpret_cast<const float*>(a->bytes.data())[11] == 2.75f);
  auto b = readNpy(path + ".i8.npy");
  REQUIRE(b.isOk());
  CHECK(b->shape == std::vector<int64_t>{3});
  CHECK(reinterpret_cast<const int64_t*>(b->bytes.data())[1] == -1);
  auto fortran = readNpy(path + ".f.npy");
  CHECK(fortran.status().message().find("fortran_order is True") != std::string::npos);
}

TEST_CASE("malformed .npy headers give a clear error") {
  const std::string data(24, '\0');
  struct Case {
    std::string bytes;
    std::string expected;
  };
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  CHECK(parseNpyHeader(npyWith(good, data)).isOk());
  const Case cases[] = {
      {"PK\x03\x04 a zip file, not npy", "magic"},
      {npyWith(good, data).substr(0, 40), "truncated"},
      {npyWith("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }", data), "'<f8' is not supported"},
      {npyWith("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", data), "'>f4' is not supported"},
      {npyWith("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", data), "fortran_order is True"},
      {npyWith("{'descr': '<f4', 'shape': (2, 3), }", data), "'fortran_order' is missing"},
      {npyWith("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", data), "shape must be a tuple"},
      {npyWith("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", data), "non-negative integers"},
      {npyWith("{'descr': '<f4' 'fortran_order': False}", data), "expected ','"},
      {npyWith("'descr': '<f4'", data), "expected '{'"},
      {npyWith("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}", data), "unexpected key 'extra'"},
      {std::string("\x93NUMPY\x09\x00\x10\x00", 10) + good, "version 9.0"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.expected);
    auto header = parseNpyHeader(c.bytes);
    REQUIRE_FALSE(header.isOk());
    CHECK(header.status().code() == StatusCode::kInvalidArgument);
    INFO(header.status().message());
    CHECK(header.status().message().find(c.expected) != std::string::npos);
  }
  // The header is fine but the data is short: readNpy says how much is missing.
  TempDir dir;
  writeAll(dir.path() + "/short.npy", npyWith(good, std::string(20, '\0')));
  auto short_data = readNpy(dir.path() + "/short.npy");
  CHECK(short_data.status().code() == StatusCode::kInvalidArgument);
  CHECK(short_data.status().message().find("24 bytes of data") != std::string::npos);
}

}  // namespace
}  // namespace troupe::actors
