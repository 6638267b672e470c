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

// What Python's bytes.decode("utf-8", "backslashreplace") gives for the same bytes.
TEST(Error, InvalidUtf8IsEscapedAsPythonDoes) {
  using tandem::escape_invalid_utf8;
  EXPECT_EQ(escape_invalid_utf8("plain"), "plain");
  EXPECT_EQ(escape_invalid_utf8("a\xff" "b"), "a\\xffb");
  EXPECT_EQ(escape_invalid_utf8("\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(escape_invalid_utf8("\xc0\xaf"), "\\xc0\\xaf");            // overlong
  EXPECT_EQ(escape_invalid_utf8("\xed\xa0\x80"), "\\xed\\xa0\\x80");   // a surrogate
  EXPECT_EQ(escape_invalid_utf8("\xe2\x82" "A"), "\\xe2\\x82A");       // cut short
  EXPECT_EQ(escape_invalid_utf8("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // above U+10FFFF
  EXPECT_EQ(escape_invalid_utf8("end\xe2"), "end\\xe2");
}
