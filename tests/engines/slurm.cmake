# A real Slurm on this host (munged, slurmctld, slurmd in a temporary folder, loopback)
# runs examples/cluster/hddp.sbatch with 2 CPU ranks: a plain job, then one that its
# time-limit trap requeues and that resumes from its last commit. Skips (77) where Slurm
# or MUNGE cannot be installed or started; docs/cluster.md "Slurm" says what it checks.
add_test(NAME engines.slurm_sbatch_trains_and_resumes_after_requeue
         COMMAND bash "${HDDP_ENGINES_DIR}/slurm_test.sh" "$<TARGET_FILE:train_resnet>"
                 "${PROJECT_SOURCE_DIR}/examples/cluster/hddp.sbatch")
set_tests_properties(engines.slurm_sbatch_trains_and_resumes_after_requeue PROPERTIES
  LABELS "engines;slow" TIMEOUT 600 SKIP_RETURN_CODE 77)
