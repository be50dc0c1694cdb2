# Kubernetes: Kubeflow's PyTorchJob (deploy/). No cluster and no container runtime here,
# so the manifest and the Containerfile are checked for what can be checked without them,
# and the image's entry script runs as two pods would, on loopback, with the variables
# the training operator would give them. deploy/README.md describes the deployment.

# The manifest's fields as the operator reads them, the Containerfile's COPY sources,
# options and torch pin, a self-check on mutated copies, and the trainer taking the
# manifest's arguments (one step on the CPU).
add_test(NAME engines.pytorchjob_manifest_has_what_the_operator_reads
         COMMAND "${HDDP_TEST_PYTHON}" "${HDDP_ENGINES_DIR}/pytorchjob_manifest_test.py"
                 --trainer "train_resnet=$<TARGET_FILE:train_resnet>")
set_tests_properties(engines.pytorchjob_manifest_has_what_the_operator_reads PROPERTIES
                     LABELS engines TIMEOUT 120)

# deploy/entrypoint.sh as two pods of the manifest's elastic job (torchrun's c10d
# rendezvous on 127.0.0.1) training train_resnet on CPU ranks: one job of 2 ranks.
add_test(NAME engines.pytorchjob_two_pods_form_one_job
         COMMAND "${HDDP_TEST_PYTHON}" "${HDDP_ENGINES_DIR}/pytorchjob_entry_test.py"
                 --trainer "$<TARGET_FILE:train_resnet>"
                 --torchrun "${HDDP_TEST_PYTHON_BIN}/torchrun" --timeout 120)
set_tests_properties(engines.pytorchjob_two_pods_form_one_job PROPERTIES
                     LABELS "engines;slow" TIMEOUT 300 PROCESSORS 2)
