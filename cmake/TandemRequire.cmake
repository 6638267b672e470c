# tandem_require(FOUND_VAR WHAT PACKAGES): stop the configure step, naming what is
# missing and the Debian / Ubuntu package(s) that provide it, when FOUND_VAR is false.
#   tandem_require(YAML_FOUND "libyaml (placement configs)" libyaml-dev)
# -> CMake Error: tandem needs libyaml (placement configs): apt-get install libyaml-dev
#    (or set CMAKE_PREFIX_PATH to where it is installed)
macro(tandem_require found what packages)
  if(NOT ${found})
    message(FATAL_ERROR "tandem needs ${what}: apt-get install ${packages}\n"
                        "(or set CMAKE_PREFIX_PATH to where it is installed; scripts/setup.sh installs "
                        "every system package tandem uses)")
  endif()
endmacro()
