# CMake generated Testfile for 
# Source directory: /work/main/tests/fuzz
# Build directory: /work/main/build-tsan/tests/fuzz
# 
# This file includes the relevant testing commands required for 
# testing this directory and lists subdirectories to be tested as well.
add_test([=[fuzz.safetensors_header]=] "/work/main/build-tsan/tests/fuzz/fuzz_safetensors_header" "-max_total_time=20" "-rss_limit_mb=2048" "-timeout=10" "-print_final_stats=1" "/work/main/build-tsan/tests/fuzz/corpus" "/work/main/tests/fuzz/corpus")
set_tests_properties([=[fuzz.safetensors_header]=] PROPERTIES  TIMEOUT "120" _BACKTRACE_TRIPLES "/work/main/tests/fuzz/CMakeLists.txt;34;add_test;/work/main/tests/fuzz/CMakeLists.txt;0;")
