# The sources of fsdp_ckpt_core: the checkpoint code that needs HDF5 and c10 (for its
# errors) but not the rest of LibTorch. One list for the library (CMakeLists.txt) and
# the fuzz targets (tests/fuzz/CMakeLists.txt), as absolute paths.
set(FSDP_CKPT_CORE_SOURCES
    h5/h5.cpp h5/h5_convert.cpp h5/h5_geometry.cpp h5/h5_checksums.cpp h5/h5_dataset.cpp
    h5/h5_direct.cpp
    safetensors/safetensors.cpp layout.cpp offline.cpp inspect.cpp publish.cpp reshard_plan.cpp)
list(TRANSFORM FSDP_CKPT_CORE_SOURCES PREPEND ${CMAKE_CURRENT_LIST_DIR}/)
