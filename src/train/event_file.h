// TensorBoard's event files below hddp::TensorBoardWriter (internal to the train layer):
// CRC-32C, the TFRecord framing of each record, and the Event messages serialized.
//
// Neither LibTorch nor protobuf appears here, and event_file.cpp is compiled apart from
// LibTorch (src/CMakeLists.txt): the torch wheel's include folder carries an older
// protobuf's headers, which would shadow the protobuf that generated our messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hddp {
namespace train {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord files use:
/// crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* data, size_t size);

/// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8 of crc32c(data).
uint32_t maskedCrc32c(const void* data, size_t size);

/// One TFRecord: the length as uint64 little-endian, the masked CRC of those 8 bytes,
/// the data, the masked CRC of the data (each CRC uint32 little-endian).
std::string frameRecord(const std::string& data);

/// "brain.Event:2", the version TensorBoard expects first in every event file.
extern const char* const kEventFileVersion;

/// Serialized tensorboard.Event messages; `wallTime` in seconds since the Unix epoch.
namespace events {

/// The first event of a file: its version (kEventFileVersion).
std::string fileVersion(double wallTime);

/// A scalar summary (Summary.Value.simple_value, a float32).
std::string scalar(const std::string& tag, float value, int64_t step, double wallTime);

/// A text summary for TensorBoard's text plugin: a rank-0 string tensor (markdown).
std::string text(const std::string& tag, const std::string& text, int64_t step, double wallTime);

/// SessionLog START at `step`: TensorBoard drops the events of earlier files from that
/// step on (a resumed run repeats the steps after its state file).
std::string sessionStart(int64_t step, double wallTime);

}  // namespace events
}  // namespace train
}  // namespace hddp
