#----------------------------------------------------------------
# Generated CMake target import file for configuration "Debug".
#----------------------------------------------------------------

# Commands may need to know the format version.
set(CMAKE_IMPORT_FILE_VERSION 1)

# Import target "tandem::tandem" for configuration "Debug"
set_property(TARGET tandem::tandem APPEND PROPERTY IMPORTED_CONFIGURATIONS DEBUG)
set_target_properties(tandem::tandem PROPERTIES
  IMPORTED_LINK_INTERFACE_LANGUAGES_DEBUG "CXX"
  IMPORTED_LOCATION_DEBUG "${_IMPORT_PREFIX}/lib/libtandem.a"
  )

list(APPEND _cmake_import_check_targets tandem::tandem )
list(APPEND _cmake_import_check_files_for_tandem::tandem "${_IMPORT_PREFIX}/lib/libtandem.a" )

# Commands beyond this point should not need to know the version.
set(CMAKE_IMPORT_FILE_VERSION)
