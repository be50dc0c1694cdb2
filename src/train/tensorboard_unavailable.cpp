// TensorBoardWriter in an hddp built without protobuf (src/CMakeLists.txt): it cannot
// write event files, and says what to install.
#include "hddp/core/error.h"
#include "hddp/train/tensorboard.h"

namespace hddp {

bool tensorBoardAvailable() noexcept { return false; }

class TensorBoardWriter::Impl {};

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  HDDP_THROW(ConfigError, "cannot write TensorBoard event files into ", dir,
             ": this hddp was built without protobuf. Install libprotobuf-dev and "
             "protobuf-compiler (scripts/setup.sh does), configure and build hddp again");
}

TensorBoardWriter::~TensorBoardWriter() = default;
TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&&) noexcept = default;

// Unreachable: no writer is ever constructed.
void TensorBoardWriter::addScalar(const std::string&, double, int64_t, std::optional<double>) {}
void TensorBoardWriter::addText(const std::string&, const std::string&, int64_t,
                                std::optional<double>) {}
void TensorBoardWriter::markStart(int64_t, std::optional<double>) {}
void TensorBoardWriter::flush() {}
bool TensorBoardWriter::failed() const { return false; }
const std::string& TensorBoardWriter::path() const {
  static const std::string kNone;
  return kNone;
}

}  // namespace hddp
