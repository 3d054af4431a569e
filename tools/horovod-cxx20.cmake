# Included after Horovod's project(): whatever compiles as "C++14" gets -std=c++20 instead.
set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++20")
