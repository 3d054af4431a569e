# Horovod 0.28.1 (its last release) asks CMake for C++14; torch 2.14's headers need C++20.
# A toolchain file is read before any project() line, so Horovod's sources stay untouched:
# it only names a file that CMake includes right after each project() (CMAKE_PROJECT_INCLUDE).
set(CMAKE_PROJECT_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/horovod-cxx20.cmake")
