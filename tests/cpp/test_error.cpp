#include <gtest/gtest.h>

#include "tandem/error.h"

namespace tandem {
namespace {

void fails_with_values(int n, const char* name) {
  TANDEM_CHECK(n < 3, Errc::invalid_argument, "tensor '", name, "' has ", n, " dims, want < 3");
}

TEST(Error, CheckCarriesCodeMessageAndLocation) {
  try {
    fails_with_values(5, "w");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_EQ(e.message(), "tensor 'w' has 5 dims, want < 3");
    EXPECT_STREQ(e.file(), "tests/cpp/test_error.cpp");
    EXPECT_GT(e.line(), 0);
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("tensor 'w' has 5 dims, want < 3  [check 'n < 3' failed at tests/cpp/test_error.cpp:", 0), 0u) << what;
  }
}

TEST(Error, PassingCheckDoesNotEvaluateMessage) {
  int evaluated = 0;
  auto side = [&] { return ++evaluated; };
  TANDEM_CHECK(true, Errc::internal, "never ", side());
  EXPECT_EQ(evaluated, 0);
}

TEST(Error, FailIsUnconditionalAndTyped) {
  EXPECT_THROW(TANDEM_FAIL(Errc::io, "disk"), Error);
  try {
    TANDEM_FAIL(Errc::unsupported, "no ", "amx");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_EQ(e.message(), "no amx");
  }
}

TEST(Error, IsAStdRuntimeError) {
  EXPECT_THROW(TANDEM_FAIL(Errc::internal, "x"), std::runtime_error);
}

TEST(Error, CodeNames) {
  EXPECT_EQ(errc_name(Errc::invalid_argument), "invalid_argument");
  EXPECT_EQ(errc_name(Errc::bad_format), "bad_format");
  EXPECT_EQ(errc_name(Errc::io), "io");
}

}  // namespace
}  // namespace tandem
