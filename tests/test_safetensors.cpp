// The safetensors writer and reader against the format's rules (Note [Safetensors]):
// header length and padding, offsets, dtype names, Hugging Face's file split and index,
// and every malformed file the reader must refuse.
#include "../checkpoint/format/safetensors/safetensors.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
using namespace fsdp::st;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_safetensors_cases {

namespace {

std::string scratch(const std::string& tag) {
  std::string t = (fs::temp_directory_path() / ("fsdp_st_" + tag + "_XXXXXX")).string();
  if (::mkdtemp(t.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return t;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

uint64_t le64(const std::string& s) {
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(s[static_cast<size_t>(k)]);
  return n;
}

// A file with the given raw header JSON and data, built by hand (no padding unless given).
std::string raw_file(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  for (int k = 0; k < 8; ++k)
    out[static_cast<size_t>(k)] = static_cast<char>((json.size() >> (8 * k)) & 0xff);
  return out + json + data;
}

std::string error_of(const std::string& path) {
  try {
    Reader r(path);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

const std::vector<Spec> kSpecs = {
    {"a.weight", "F32", {2, 3}}, {"b", "BF16", {5}}, {"step", "I64", {}}, {"empty", "F16", {0, 4}}};

TEST(Safetensors, HeaderHasItsLengthPaddingAndContiguousOffsets) {
  const std::string h = header_bytes(kSpecs, {0, 1, 2, 3}, {{"format", "pt"}, {"step", "7"}});
  const uint64_t n = le64(h);
  ASSERT_EQ(h.size(), 8 + n);
  EXPECT_EQ(n % 8, 0u) << "the data must start 8-byte aligned";
  const std::string json = h.substr(8);
  const size_t last = json.find_last_not_of(' ');
  EXPECT_EQ(json[last], '}');
  EXPECT_LT(json.size() - 1 - last, 8u) << "more padding than alignment needs";
  auto j = nlohmann::ordered_json::parse(json);
  EXPECT_EQ(j.begin().key(), "__metadata__");
  EXPECT_EQ(j["__metadata__"]["step"], "7");
  EXPECT_EQ(j["a.weight"]["dtype"], "F32");
  EXPECT_EQ(j["a.weight"]["data_offsets"], nlohmann::ordered_json::array({0, 24}));
  EXPECT_EQ(j["b"]["data_offsets"], nlohmann::ordered_json::array({24, 34}));
  EXPECT_EQ(j["step"]["shape"], nlohmann::ordered_json::array());
  EXPECT_EQ(j["step"]["data_offsets"], nlohmann::ordered_json::array({34, 42}));
  EXPECT_EQ(j["empty"]["data_offsets"], nlohmann::ordered_json::array({42, 42}));
  // Without metadata there is no __metadata__ key.
  EXPECT_FALSE(
      nlohmann::json::parse(header_bytes(kSpecs, {0}, {}).substr(8)).contains("__metadata__"));
}

TEST(Safetensors, DtypeNamesAndSizes) {
  EXPECT_EQ(dtype_size("F32"), 4u);
  EXPECT_EQ(dtype_size("BF16"), 2u);
  EXPECT_EQ(dtype_size("F16"), 2u);
  EXPECT_EQ(dtype_size("I64"), 8u);
  EXPECT_EQ(dtype_size("U8"), 1u);
  try {
    dtype_size("FP32");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("safetensors dtype 'FP32' is not known"),
              std::string::npos);
  }
}

TEST(Safetensors, FilesAreSplitAsHuggingFaceSplitsThem) {
  // 16, 16, 40, 8, 8 bytes with a 32-byte limit: [16 16] [40] [8 8]; the 40-byte tensor
  // is over the limit and alone.
  std::vector<Spec> s = {{"t0", "F32", {4}},
                         {"t1", "F32", {4}},
                         {"t2", "F32", {10}},
                         {"t3", "F32", {2}},
                         {"t4", "F32", {2}}};
  auto files = plan_files(s, 32);
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0].tensors, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(files[1].tensors, (std::vector<size_t>{2}));
  EXPECT_EQ(files[2].tensors, (std::vector<size_t>{3, 4}));
  EXPECT_EQ(files[0].name, "model-00001-of-00003.safetensors");
  EXPECT_EQ(files[2].name, "model-00003-of-00003.safetensors");
  EXPECT_EQ(files[1].data_bytes, 40u);
  auto one = plan_files(s, 1000);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].name, "model.safetensors");
  auto idx = nlohmann::json::parse(index_json(s, files));
  EXPECT_EQ(idx["metadata"]["total_size"], 88);
  EXPECT_EQ(idx["weight_map"]["t2"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(idx["weight_map"].size(), 5u);
}

TEST(Safetensors, WrittenFilesReadBackExactlyAloneAndThroughTheIndex) {
  const std::string dir = scratch("rt");
  std::vector<std::string> data(kSpecs.size());
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    data[i].resize(nbytes(kSpecs[i]));
    for (size_t b = 0; b < data[i].size(); ++b) data[i][b] = static_cast<char>(17 * i + 3 * b + 1);
  }
  DirWriter w(dir, kSpecs, {{"format", "pt"}}, 25);  // [a.weight] [b step empty]
  const auto files = w.files();
  ASSERT_EQ(files.size(), 2u);
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    w.add(i, data[i].data(), data[i].size());
    EXPECT_FALSE(fs::exists(dir + "/" + files[0].name)) << "published before finish()";
  }
  w.finish();
  EXPECT_TRUE(is_safetensors(dir));
  EXPECT_EQ(slurp(dir + "/model.safetensors.index.json"), index_json(kSpecs, files));
  for (const std::string& path : {dir, dir + "/model.safetensors.index.json"}) {
    Reader r(path);
    ASSERT_EQ(r.entries().size(), kSpecs.size());
    EXPECT_EQ(r.metadata().at("format"), "pt");
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const Entry& e = r.entries().at(kSpecs[i].name);
      EXPECT_EQ(e.dtype, kSpecs[i].dtype);
      EXPECT_EQ(e.shape, kSpecs[i].shape);
      std::string got(data[i].size(), '\0');
      if (!got.empty()) r.read(kSpecs[i].name, 0, got.size(), got.data());
      EXPECT_EQ(got, data[i]) << kSpecs[i].name;
    }
    std::string part(8, '\0');  // a range in the middle of a tensor
    r.read("a.weight", 4, 8, part.data());
    EXPECT_EQ(part, data[0].substr(4, 8));
  }
  Reader single(dir + "/" + files[0].name);
  EXPECT_EQ(single.entries().size(), 1u);

  // Exported again into one file: the earlier export's files and index are gone.
  DirWriter again(dir, kSpecs, {}, 1000);
  for (size_t i = 0; i < kSpecs.size(); ++i) again.add(i, data[i].data(), data[i].size());
  again.finish();
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"model.safetensors"}));
  EXPECT_EQ(Reader(dir).entries().size(), kSpecs.size());
  fs::remove_all(dir);
}

TEST(Safetensors, AnUnfinishedWriterLeavesNoFile) {
  const std::string dir = scratch("abandon");
  {
    FileWriter w(dir + "/model.safetensors", header_bytes(kSpecs, {0}, {}), 24);
    w.append("abcd", 4);
  }
  EXPECT_TRUE(fs::is_empty(dir));
  {
    DirWriter w(dir, kSpecs, {}, 1);  // four files; two written, none published
    w.add(0, std::string(24, 'x').data(), 24);
    w.add(1, std::string(10, 'y').data(), 10);
  }
  EXPECT_TRUE(fs::is_empty(dir));
  {
    FileWriter w(dir + "/model.safetensors", header_bytes(kSpecs, {0}, {}), 24);
    w.append("abcd", 4);
    try {
      w.finish();
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace())
                    .find("got 4 bytes of data, its header declares 24"),
                std::string::npos);
    }
  }
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  spit(dir + "/taken", "a file, not a directory");
  try {
    DirWriter w(dir + "/taken", kSpecs, {}, 100);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("cannot create the export directory " + dir + "/taken"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  fs::remove_all(dir);
}

TEST(Safetensors, TheReaderRefusesEveryMalformedFileNamingTheRule) {
  const std::string dir = scratch("bad");
  const std::string f = dir + "/x.safetensors";
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    std::string bytes, message;
  };
  std::string huge(8, '\0');
  huge[4] = 0x10;  // 2^36: over the 100 MB limit
  const std::vector<Case> cases = {
      {"abc", "shorter than its 8-byte header length"},
      {huge, "is over the format's limit of 100 MB"},
      {raw_file("{" + ok_entry + "}", "1234"), "lie outside the 4 bytes of data"},
      {raw_file("[1]", ""), "the header does not start with '{'"},
      {raw_file("{\"t\":", ""), "the header is not valid JSON"},
      {raw_file(R"({"t":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", "12345678"),
       "dtype 'F33' is not known"},
      {raw_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678"),
       "needs 12 bytes but"},
      {raw_file(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", "12345678"),
       "not a non-negative"},
      {raw_file(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "12345678"),
       "leave a gap at byte 0"},
      {raw_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                "12345678"),
       "overlap at byte 4"},
      {raw_file("{" + ok_entry + "}", "123456789"), "1 bytes after the last tensor's data"},
      {raw_file(R"({"__metadata__":{"a":1}})", ""), "__metadata__[\"a\"] is not a string"},
      {raw_file(R"({"t":{"dtype":"F32","shape":[2]}})", ""), "lacks dtype, shape or data_offsets"},
  };
  // Every refusal closes the file it opened (fuzzing found one leaked per rejected file).
  auto open_fds = [] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
      n += e.is_symlink() ? 1 : 0;
    return n;
  };
  const int fds = open_fds();
  for (const auto& c : cases) {
    spit(f, c.bytes);
    const std::string msg = error_of(f);
    EXPECT_NE(msg.find(c.message), std::string::npos) << "want: " << c.message << "\ngot: " << msg;
    EXPECT_EQ(open_fds(), fds) << "a file descriptor left open after: " << c.message;
  }
  // An index that disagrees with its files.
  spit(dir + "/a.safetensors", raw_file("{" + ok_entry + "}", "12345678"));
  spit(dir + "/model.safetensors.index.json",
       R"({"weight_map":{"t":"a.safetensors","v":"a.safetensors"}})");
  EXPECT_NE(error_of(dir).find("names tensor 'v' in a.safetensors, which does not hold it"),
            std::string::npos)
      << error_of(dir);
  spit(dir + "/model.safetensors.index.json", R"({"weight_map":{"t":"../a.safetensors"}})");
  EXPECT_NE(error_of(dir).find("which is not a file beside the index"), std::string::npos)
      << error_of(dir);
  EXPECT_NE(error_of(dir + "/none.safetensors").find("does not exist"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace

}  // namespace test_safetensors_cases
