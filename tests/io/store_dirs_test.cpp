// The store's directories: each one SSD, so the same directory under two spellings is refused,
// and an empty name is refused rather than read as "no directory given".
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/store.hpp"

namespace tidal::io {
namespace {

using testing::TestDir;

// The message of the InvalidArgument that opening a store on `dirs` throws ("" if it opens).
std::string refusal(const std::vector<std::string>& dirs) {
  StoreOptions o;
  o.dirs = dirs;
  o.capacity = 4 * kMiB * dirs.size();
  try {
    TensorStore store(o);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(StoreDirs, TheSameDirectoryTwiceIsRefusedUnderAnySpelling) {
  TestDir t;
  const std::string d = t.sub("ssd0");
  const std::string link = t.path() + "/link-to-ssd0";
  std::filesystem::create_directory_symlink(d, link);
  for (const std::vector<std::string>& dirs : {std::vector<std::string>{d, d},
                                               {d, d + "/"},
                                               {d, t.path() + "/./ssd0"},
                                               {d, t.sub("other") + "/../ssd0"},
                                               {d, link},
                                               {t.sub("ssd1"), d, link}}) {
    const std::string msg = refusal(dirs);
    ASSERT_FALSE(msg.empty()) << dirs.front() << " and " << dirs.back() << " were accepted";
    EXPECT_NE(msg.find("same directory"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dirs.back()), std::string::npos) << "names the second spelling: " << msg;
  }
  // Distinct directories, on one disk or not, are the caller's to choose.
  EXPECT_EQ(refusal({d, t.sub("ssd1")}), "");
}

TEST(StoreDirs, AnEmptyNameIsRefused) {
  TestDir t;
  for (const std::vector<std::string>& dirs : {std::vector<std::string>{""}, {t.sub("a"), ""}}) {
    const std::string msg = refusal(dirs);
    EXPECT_NE(msg.find("empty name"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace tidal::io
