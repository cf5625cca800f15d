//===- SafetensorsTest.cpp - safetensors round trips and validation -------===//

#include "carve/rt/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

using namespace carve::rt;

namespace {

/// A fresh folder per test, removed with its files afterwards.
class SafetensorsTest : public ::testing::Test {
protected:
  void SetUp() override {
    char tmpl[] = "/tmp/carve-st-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir = tmpl;
  }
  void TearDown() override {
    for (const std::string &f : files())
      ::unlink((dir + "/" + f).c_str());
    ::rmdir(dir.c_str());
  }
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    if (DIR *d = ::opendir(dir.c_str())) {
      while (dirent *e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, ".."))
          names.push_back(e->d_name);
      ::closedir(d);
    }
    return names;
  }
  std::string path(const char *name) const { return dir + "/" + name; }

  /// Writes a raw file: header length `len`, then `header`, then `data`.
  std::string raw(const std::string &header, const std::string &data = "", int64_t len = -1) const {
    std::string p = path("raw.safetensors");
    std::ofstream f(p, std::ios::binary);
    uint64_t n = len < 0 ? header.size() : static_cast<uint64_t>(len);
    for (int i = 0; i < 8; ++i)
      f.put(static_cast<char>(n >> (8 * i)));
    f << header << data;
    return p;
  }

  /// Opening a raw file fails with an error naming the file and containing `cause`.
  void expectInvalid(const std::string &header, const std::string &data, const char *cause,
                     int64_t len = -1) {
    std::string p = raw(header, data, len);
    SafetensorsReader r;
    std::string error;
    EXPECT_FALSE(r.open(p, error)) << header;
    EXPECT_EQ(error.rfind(p + ": ", 0), 0u) << error;
    EXPECT_NE(error.find(cause), std::string::npos) << "error: " << error;
  }

  std::string dir;
};

TEST_F(SafetensorsTest, RoundTripKeepsOrderShapesValuesAndMetadata) {
  float w[6] = {1, -2, 3.5f, 4, 5, 6};
  int64_t steps[1] = {42};
  double scalar = 0.25;
  std::vector<SafetensorsEntry> in = {{"z.weight", "F32", {2, 3}, w},
                                      {"a.count", "I64", {1}, steps},
                                      {"empty", "F32", {0, 4}, nullptr},
                                      {"scalar", "F64", {}, &scalar}};
  std::string error;
  ASSERT_TRUE(writeSafetensors(path("m.safetensors"), in, {{"step", "7"}, {"format", "x"}}, error))
      << error;
  EXPECT_EQ(files(), std::vector<std::string>{"m.safetensors"}); // no temporary left

  SafetensorsReader r;
  ASSERT_TRUE(r.open(path("m.safetensors"), error)) << error;
  ASSERT_EQ(r.tensors().size(), 4u);
  EXPECT_EQ(r.tensors()[0].name, "z.weight"); // header order is the given order
  EXPECT_EQ(r.tensors()[3].name, "scalar");
  EXPECT_EQ(r.metadata().at("step"), "7");
  EXPECT_EQ(r.metadata().at("format"), "x");

  const SafetensorsTensor *t = r.find("z.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, "F32");
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->numel, 6);
  float back[6];
  ASSERT_TRUE(r.read(*t, 0, sizeof back, back, error)) << error;
  EXPECT_EQ(std::memcmp(back, w, sizeof w), 0);
  float tail[2];
  ASSERT_TRUE(r.read(*t, 16, 8, tail, error)) << error;
  EXPECT_EQ(tail[0], 5);
  EXPECT_EQ(tail[1], 6);
  EXPECT_FALSE(r.read(*t, 16, 12, tail, error)); // past the tensor's end
  EXPECT_NE(error.find("outside its data"), std::string::npos) << error;

  int64_t count = 0;
  ASSERT_TRUE(r.read(*r.find("a.count"), 0, 8, &count, error));
  EXPECT_EQ(count, 42);
  EXPECT_EQ(r.find("empty")->numel, 0);
  EXPECT_TRUE(r.find("scalar")->shape.empty());
  EXPECT_EQ(r.find("missing"), nullptr);

  // The format: little-endian length, header padded to 8 with spaces.
  std::ifstream f(path("m.safetensors"), std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string bytes = ss.str();
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = n << 8 | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  EXPECT_EQ(bytes.size(), 8 + n + sizeof w + 8 + 8);
}

TEST_F(SafetensorsTest, NoMetadataAndNoTensors) {
  std::string error;
  ASSERT_TRUE(writeSafetensors(path("e.safetensors"), {}, {}, error)) << error;
  SafetensorsReader r;
  ASSERT_TRUE(r.open(path("e.safetensors"), error)) << error;
  EXPECT_TRUE(r.tensors().empty());
  EXPECT_TRUE(r.metadata().empty());
}

TEST_F(SafetensorsTest, OverwriteReplacesAndAFailedWriteKeepsTheOldFile) {
  float a = 1, b = 2;
  std::string error;
  ASSERT_TRUE(writeSafetensors(path("m.safetensors"), {{"a", "F32", {1}, &a}}, {}, error));
  ASSERT_TRUE(writeSafetensors(path("m.safetensors"), {{"b", "F32", {1}, &b}}, {}, error));
  SafetensorsReader r;
  ASSERT_TRUE(r.open(path("m.safetensors"), error)) << error;
  EXPECT_EQ(r.find("a"), nullptr);
  ASSERT_NE(r.find("b"), nullptr);

  EXPECT_FALSE(writeSafetensors(path("m.safetensors"),
                                {{"c", "F32", {1}, &a}, {"c", "F32", {1}, &b}}, {}, error));
  SafetensorsReader again;
  ASSERT_TRUE(again.open(path("m.safetensors"), error)) << error;
  EXPECT_NE(again.find("b"), nullptr);
  EXPECT_EQ(files(), std::vector<std::string>{"m.safetensors"});
}

TEST_F(SafetensorsTest, WriteErrorsNameTheFileAndTheCause) {
  float v = 0;
  std::string error;
  auto fails = [&](std::vector<SafetensorsEntry> t, const char *cause, const std::string &p = "") {
    std::string target = p.empty() ? path("w.safetensors") : p;
    EXPECT_FALSE(writeSafetensors(target, t, {}, error));
    EXPECT_EQ(error.rfind(target + ": ", 0), 0u) << error;
    EXPECT_NE(error.find(cause), std::string::npos) << error;
  };
  fails({{"a", "F32", {1}, &v}, {"a", "F32", {1}, &v}}, "tensor 'a' given twice");
  fails({{"a", "F17", {1}, &v}}, "unknown dtype \"F17\"");
  fails({{"__metadata__", "F32", {1}, &v}}, "invalid tensor name");
  fails({{"", "F32", {1}, &v}}, "invalid tensor name");
  fails({{"a", "F32", {-1}, &v}}, "negative dimension");
  fails({{"a", "F32", {2}, nullptr}}, "no data");
  fails({{"a", "F32", {1}, &v}}, "cannot create a temporary file", dir + "/no/such/dir/w");
  EXPECT_TRUE(files().empty());
}

TEST_F(SafetensorsTest, FileLevelErrors) {
  SafetensorsReader r;
  std::string error;
  EXPECT_FALSE(r.open(path("missing"), error));
  EXPECT_NE(error.find("cannot open"), std::string::npos) << error;
  EXPECT_FALSE(r.open(dir, error));
  EXPECT_NE(error.find("not a regular file"), std::string::npos) << error;

  {
    std::ofstream f(path("short"), std::ios::binary);
    f << "abc";
  }
  EXPECT_FALSE(r.open(path("short"), error));
  EXPECT_NE(error.find("3 bytes, too short"), std::string::npos) << error;

  expectInvalid("{}", "", "header length 0 is not between", 0);
  expectInvalid("{}", "", "header length 1000000000 is not between", 1000000000);
  expectInvalid("{}", "", "header length 64 exceeds the file size 10", 64);
  expectInvalid("[1, 2]", "", "does not start with '{'");
  expectInvalid("{\"a\": ", "", "header is not valid JSON");
  expectInvalid("{} x", "", "header is not valid JSON");
}

TEST_F(SafetensorsTest, EntryErrors) {
  std::string eight(8, '\0');
  expectInvalid(R"({"a": 3})", "", "tensor 'a': header entry is not a JSON object");
  expectInvalid(R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", eight,
                "tensor 'a': missing or non-string \"dtype\"");
  expectInvalid(R"({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", eight,
                "unknown dtype \"F33\"");
  expectInvalid(R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})", eight,
                "missing or non-array \"shape\"");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight,
                "\"shape\" holds -2, not a non-negative integer");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", eight,
                "\"shape\" holds 2.5");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", eight,
                "\"data_offsets\" must be [begin, end]");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [2]}})", eight, "\"data_offsets\"");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", eight,
                "data_offsets [0, 16] lie outside the data section of 8 bytes");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", eight,
                "lie outside");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight,
                "shape [3] of F32 needs 12 bytes, data_offsets give 8");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 16],)"
                R"( "data_offsets": [0, 8]}})",
                eight, "needs more bytes than the file has");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                R"( "b": {"dtype": "I32", "shape": [1], "data_offsets": [4, 8]}})",
                eight, "tensors 'a' and 'b' overlap");
  expectInvalid(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                eight, "header names 'a' twice");
  expectInvalid(R"({"__metadata__": [1]})", "", "\"__metadata__\" is not a JSON object");
  expectInvalid(R"({"__metadata__": {"step": 3}})", "",
                "\"__metadata__\" value of 'step' is not a string");
}

TEST_F(SafetensorsTest, ReadsFilesOfOtherWriters) {
  // As Python's safetensors writes it: metadata first, dtypes carve does not
  // compute in, an unpadded header, trailing spaces inside it.
  std::string data(10, '\x01');
  std::string p = raw(R"({"__metadata__": {"format": "pt"}, )"
                      R"("h": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}, )"
                      R"("b": {"dtype": "BOOL", "shape": [2, 2], "data_offsets": [6, 10]}}   )",
                      data);
  SafetensorsReader r;
  std::string error;
  ASSERT_TRUE(r.open(p, error)) << error;
  EXPECT_EQ(r.find("h")->dtype, "BF16");
  EXPECT_EQ(r.find("b")->numel, 4);
  EXPECT_EQ(r.metadata().at("format"), "pt");
}

} // namespace
