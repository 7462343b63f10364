# How the root's llama-cpp-python (tokenizer, chat template, and the suite's reference) builds llama.cpp:
# included by CMake right after llama.cpp's project() (CMAKE_PROJECT_llama.cpp_INCLUDE), from the Makefile
# and tests/reference/build_avx2.sh.

# llama.cpp's `common` (argument parsing, chat parsers, a Jinja engine, an HTTP client: over half the
# build's CPU) is not loaded by the bindings, but their CMakeLists turns it on with FORCE: off again
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "" FORCE)

# libllama's own sources compiled in unity batches, as llama.cpp already compiles its src/models/: they
# share their headers' parsing (the library's compile took 166 CPU-s instead of 245 here). Only libllama
# (model loading, graphs, vocabulary), not ggml, whose kernels do the arithmetic: its objects are unchanged.
if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.19)
    file(GLOB _llama_core_sources "${CMAKE_CURRENT_SOURCE_DIR}/src/*.cpp")
    cmake_language(DEFER CALL set_source_files_properties ${_llama_core_sources}
                   DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/src" PROPERTIES SKIP_UNITY_BUILD_INCLUSION OFF)
endif()
