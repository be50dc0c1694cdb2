// TensorBoard event files: scalars and text that `tensorboard --logdir DIR` shows while
// a run trains. The Trainer writes them on rank 0 when TrainerOptions::tensorboard names
// a folder (docs/train.md, "Watch it in TensorBoard"); the writer is also usable on its
// own.
//
//   hddp::TensorBoardWriter tb("runs/resnet");
//   tb.addScalar("train/loss", loss, step);
//   tb.addText("plan", "[96, 32] of 128", step);
//
// The format is TensorFlow's: TFRecord framing (length, masked CRC-32C of the length,
// data, masked CRC-32C of the data) around serialized tensorboard.Event messages, the
// first of which says "brain.Event:2". Protobuf stays inside libhddp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace hddp {

/// Whether this hddp can write event files (it was built with protobuf; without it the
/// TensorBoardWriter constructor throws hddp::ConfigError, and the Trainer refuses
/// TrainerOptions::tensorboard on every rank).
bool tensorBoardAvailable() noexcept;

/// Writes one event file in a folder.
///
/// Records are buffered in memory and reach the file (one write(2) for all of them):
/// at every flush(); at the end of an add* call once the last flush is more than 2 s
/// old or 64 KiB are waiting; and at destruction. Records added within 2 s of a flush stay
/// buffered until one of those: call flush() after a burst (the Trainer does after
/// every step) for a live TensorBoard to see it at once.
///
/// A write that fails (a full disk) throws hddp::Error naming the file, cuts the file
/// back to its last whole record, and leaves the writer failed: every later add* and
/// flush() throws hddp::Error too, so nothing is appended after a torn record and
/// nothing is lost silently. The destructor flushes, and logs a failure instead of
/// throwing.
///
/// Thread safety: not thread-safe; one thread uses a writer (or callers serialize).
/// Ownership: the writer owns its open file; moving it moves the file.
class TensorBoardWriter {
 public:
  /// Creates `dir` (and its parents) and in it the file
  /// `events.out.tfevents.<unix seconds>.<host name>.<pid>.hddp`, then writes the file
  /// version event. When the name is taken (two writers of this process in the same
  /// second), the seconds count up until it is free, so a folder's files sort in the
  /// order they were made (the order TensorBoard reads them in). Throws
  /// hddp::ConfigError naming the path when the folder or file cannot be made.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(TensorBoardWriter&&) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&&) noexcept;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// A scalar at the global `step` (stored as float32, as TensorBoard keeps scalars).
  /// `wallTime`: seconds since the Unix epoch; default now.
  void addScalar(const std::string& tag, double value, int64_t step,
                 std::optional<double> wallTime = std::nullopt);
  /// A text (markdown) for TensorBoard's Text tab.
  void addText(const std::string& tag, const std::string& text, int64_t step,
               std::optional<double> wallTime = std::nullopt);
  /// Marks that the run (re)starts at `step`: TensorBoard drops what earlier files of
  /// the folder hold at `step` and after, so a resumed run that repeats steps shows
  /// each once (TensorFlow's SessionLog START).
  void markStart(int64_t step, std::optional<double> wallTime = std::nullopt);
  /// Writes what is buffered to the file; throws hddp::Error on failure (and after one).
  void flush();
  /// Whether a write failed (every later add* and flush() throws).
  bool failed() const;
  /// The event file's path.
  const std::string& path() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hddp
