# Included by the engine build (CMAKE_PROJECT_llama_cpp_INCLUDE, set by vendor/build_engine.py) right
# after llama-cpp-python's project(): it adds llama.cpp's RPC server (tools/rpc/rpc-server.cpp, target
# ggml-rpc-server, declared as tools/rpc/CMakeLists.txt declares it) to the same CMake configuration, so
# the server is compiled from the same patched tree with the same flags, linked against the same ggml
# libraries, and installed next to them in llama_cpp/lib. Deferred to the end of the top-level
# CMakeLists: by then the ggml targets and llama_cpp_python_install_target() exist. (llama.cpp adds
# tools/rpc only with LLAMA_BUILD_TOOLS, which builds every other tool too; a deferred call may not
# add a subdirectory, hence the target here.)
cmake_minimum_required(VERSION 3.19)

function(kvlocal_add_rpc_server)
    if (NOT GGML_RPC OR NOT TARGET ggml)
        message(FATAL_ERROR "kvlocal: the RPC server needs GGML_RPC=ON")
    endif()
    # the server answers a client's question for its patch set (patch 0019) with the library's own id
    target_compile_definitions(ggml-rpc PRIVATE KVLOCAL_RPC_BUILD_ID="kvlocal:${KVLOCAL_PATCHSET_ID}")
    add_executable(ggml-rpc-server ${CMAKE_SOURCE_DIR}/vendor/llama.cpp/tools/rpc/rpc-server.cpp)
    target_link_libraries(ggml-rpc-server PRIVATE ggml)
    target_compile_features(ggml-rpc-server PRIVATE cxx_std_17)
    llama_cpp_python_install_target(ggml-rpc-server)
endfunction()

cmake_language(DEFER CALL kvlocal_add_rpc_server)
