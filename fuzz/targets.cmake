# The fuzz targets and the instrumented reader sources each compiles (the groups of
# fuzz/CMakeLists.txt); shared by fuzz/CMakeLists.txt, fuzz/main_build.cmake and, by its
# file names, scripts/fuzz.sh (one program fuzz/<target>.cpp and one corpus folder
# fuzz/corpus/<target>/ each).
set(HDDP_FUZZ_TARGETS
  fuzz_state_dict_safetensors
  fuzz_state_dict_pt
  fuzz_pickle
  fuzz_state_file
  fuzz_idx
  fuzz_cifar
  fuzz_image
  fuzz_job_record
  fuzz_launch_protocol
  fuzz_device_table
  fuzz_model_profile)
set(HDDP_FUZZ_SOURCES_fuzz_state_dict_safetensors reader_state_dict)
set(HDDP_FUZZ_SOURCES_fuzz_state_dict_pt reader_state_dict)
set(HDDP_FUZZ_SOURCES_fuzz_pickle reader_state_dict)
set(HDDP_FUZZ_SOURCES_fuzz_state_file reader_state_file)
set(HDDP_FUZZ_SOURCES_fuzz_idx reader_files)
set(HDDP_FUZZ_SOURCES_fuzz_cifar reader_files)
set(HDDP_FUZZ_SOURCES_fuzz_image reader_image)
set(HDDP_FUZZ_SOURCES_fuzz_job_record reader_job_record)
set(HDDP_FUZZ_SOURCES_fuzz_launch_protocol reader_launch)
set(HDDP_FUZZ_SOURCES_fuzz_device_table reader_planner_files)
set(HDDP_FUZZ_SOURCES_fuzz_model_profile reader_planner_files)
