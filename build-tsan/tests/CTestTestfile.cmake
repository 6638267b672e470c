# CMake generated Testfile for 
# Source directory: /work/main/tests
# Build directory: /work/main/build-tsan/tests
# 
# This file includes the relevant testing commands required for 
# testing this directory and lists subdirectories to be tested as well.
include("/work/main/build-tsan/tests/tandem_tests[1]_include.cmake")
add_test([=[install.find_package]=] "/usr/bin/cmake" "-DBUILD_DIR=/work/main/build-tsan" "-DSOURCE_DIR=/work/main/tests/install_consumer" "-DWORK_DIR=/work/main/build-tsan/tests/install_check" "-DGENERATOR=Ninja" "-P" "/work/main/tests/install_consumer/check.cmake")
set_tests_properties([=[install.find_package]=] PROPERTIES  TIMEOUT "600" _BACKTRACE_TRIPLES "/work/main/tests/CMakeLists.txt;17;add_test;/work/main/tests/CMakeLists.txt;0;")
subdirs("fuzz")
