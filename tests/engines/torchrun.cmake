# torchrun's elastic agent across two "nodes" on loopback: one is killed and comes back
# (tests/engines/torchrun_elastic_test.py says what it checks).
add_test(NAME engines.torchrun_node_leaves_and_returns_with_its_own_save_folder
         COMMAND "${HDDP_TEST_PYTHON}" "${HDDP_ENGINES_DIR}/torchrun_elastic_test.py"
                 --worker "$<TARGET_FILE:hddp_test_worker>"
                 --torchrun "${HDDP_TEST_PYTHON_BIN}/torchrun"
                 --python "${HDDP_TEST_PYTHON}"
                 --hddp-run "$<TARGET_FILE:hddp-run>")
set_tests_properties(engines.torchrun_node_leaves_and_returns_with_its_own_save_folder
                     PROPERTIES LABELS "engines;slow" TIMEOUT 300 PROCESSORS 2)
