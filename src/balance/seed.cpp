#include "hddp/balance/seed.h"

#include <array>

#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"

namespace hddp {

RankProfile seedProfile(RankProfile profile, const SeedMeasurement& measured,
                        const EmulationOptions& emulation) {
  profile.computeSecondsPerSample = measured.computeSecondsPerSample;
  profile.transferOverlapped = !profile.device.is_cpu() && measured.pinnedSideStreamCopies;
  profile.emulatedLinkBytesPerSecond = emulation.linkBytesPerSecond;
  profile.emulatedSlowdown = emulation.slowdown;
  return profile;
}

std::vector<RankCost> exchangeSeedCosts(Communicator& comm, const RankCost& mine) {
  std::vector<RankCost> costs;
  for (const auto& fields : allgatherValue(comm, costFields(mine))) {
    costs.push_back(costFromFields(fields.data()));
  }
  return costs;
}

AllreducePrediction predictAllreduce(const std::vector<RankCost>& costs, double gradientBytes) {
  AllreducePrediction p;
  p.gradientBytes = gradientBytes;
  for (size_t r = 0; r < costs.size(); ++r) {
    const double link = costs[r].linkBytesPerSecond;
    if (link > 0 && (p.slowestRank < 0 || link < p.slowestLinkBytesPerSecond)) {
      p.slowestLinkBytesPerSecond = link;
      p.slowestRank = static_cast<int>(r);
    }
  }
  p.seconds = ringAllreduceSeconds(gradientBytes, static_cast<int>(costs.size()),
                                   p.slowestLinkBytesPerSecond);
  return p;
}

}  // namespace hddp
