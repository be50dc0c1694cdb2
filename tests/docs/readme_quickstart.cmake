# README.md shows examples/quickstart/quickstart.cpp whole: the two must not drift.
file(READ "${SOURCE_DIR}/README.md" readme)
file(READ "${SOURCE_DIR}/examples/quickstart/quickstart.cpp" program)
string(FIND "${readme}" "${program}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md does not show examples/quickstart/quickstart.cpp as it is: "
                      "copy the file into README's C++ block")
endif()
