// An elastic job's record, `<job folder>/job.jsonl` (protocol/job_record.cpp): read as
// hddp-probe --job reads it, then described as text and as JSON. Torch-free, and
// documented to throw std::runtime_error naming the file (fuzz_support.h's
// refusedAsRuntimeError): a line that does not parse is skipped and counted, a line whose
// fields have unexpected types must not end the program.
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp_protocol/job_record.h"
#include "hddp_protocol/launch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hddp::fuzz::writeInput(data, size, hddp::protocol::kJobRecordFile);
  hddp::fuzz::refusedAsRuntimeError("jobrecord::read", [&] {
    const hddp::jobrecord::Job job = hddp::jobrecord::read(hddp::fuzz::scratchDir());
    hddp::jobrecord::repeatedSteps(job);
    for (const auto& g : job.generations) {
      hddp::jobrecord::reformSeconds(g);
    }
    hddp::jobrecord::describe(job, job.start + 1000.0);
    hddp::jobrecord::toJson(job).dump();
  });
  return 0;
}
