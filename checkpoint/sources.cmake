# The sources of fsdp_ckpt_core: the checkpoint code that needs HDF5 and c10 (for its
# errors) but not the rest of LibTorch. One list for the library (CMakeLists.txt) and
# the fuzz targets (tests/fuzz/CMakeLists.txt), as absolute paths.
set(FSDP_CKPT_CORE_SOURCES
    format/h5/h5.cpp format/h5/h5_convert.cpp format/h5/h5_geometry.cpp format/h5/h5_checksums.cpp
    format/h5/h5_dataset.cpp format/h5/h5_direct.cpp format/safetensors/safetensors.cpp
    format/layout.cpp format/publish.cpp format/reshard_plan.cpp offline/offline.cpp offline/inspect.cpp)
list(TRANSFORM FSDP_CKPT_CORE_SOURCES PREPEND ${CMAKE_CURRENT_LIST_DIR}/)
