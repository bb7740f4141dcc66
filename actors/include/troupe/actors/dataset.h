// Datasets the dataloader serves samples from, by sample id (0 .. size()-1):
//   - a token file (raw uint16 or uint32 tokens, little endian, no header) for language models:
//     sample i is the window of context + 1 tokens starting at token i * context; inputs are its
//     first `context` tokens and targets the `context` tokens after each one;
//   - .npy arrays (NumPy format 1.0/2.0/3.0, C order, little-endian float32 or int64) for
//     features/labels: sample i is row i of both.
// No LibTorch: batches are plain buffers (batch.h).
// Thread-safety: a Dataset is immutable once opened; batch() may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "troupe/actors/batch.h"
#include "troupe/runtime/status.h"

namespace troupe::actors {

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Number of samples.
  virtual uint64_t size() const = 0;
  // The rows of `ids`, in that order, with sample_ids = ids. kInvalidArgument names an id that
  // is not below size().
  virtual Result<Batch> batch(const std::vector<uint64_t>& ids) const = 0;
  // One line for logs: kind, path, sample count and shapes.
  virtual std::string describe() const = 0;
};

// ---- Token files ----

struct TokenDatasetOptions {
  std::string path;
  std::string token_type = "uint16";  // or "uint32"
  int64_t context = 64;               // tokens per sample's inputs
};

// Maps the file read-only. kNotFound (no such file), kInvalidArgument (token_type, context < 1,
// a size that is not a whole number of tokens, fewer than context + 1 tokens).
Result<std::unique_ptr<Dataset>> openTokenDataset(const TokenDatasetOptions& options);

// Writes every byte of the text file `text_path` as one token (0..255) of `token_type` to
// `token_path` (replaced atomically: written to a temporary name, then renamed). Returns the
// number of tokens. kNotFound, kInvalidArgument (token_type), kUnavailable (I/O errors, with
// the errno text).
Result<uint64_t> buildTokenFile(const std::string& text_path, const std::string& token_path,
                                const std::string& token_type = "uint16");

// ---- .npy arrays ----

// What the header of a .npy file says.
struct NpyHeader {
  std::string dtype;           // "float32" or "int64"
  std::vector<int64_t> shape;  // () is a scalar: shape empty
  size_t data_offset = 0;      // where the data starts in the file
};

// Parses the start of a .npy file (magic, version, header length, the header dict). Only
// little-endian float32 ('<f4') and int64 ('<i8') in C order are accepted. kInvalidArgument
// with what is wrong and where (bad magic, truncated header, a missing or malformed key,
// fortran_order True, another dtype).
Result<NpyHeader> parseNpyHeader(std::string_view file_start);

// Reads a whole .npy file. Errors as parseNpyHeader, plus kNotFound and kInvalidArgument when
// the file is shorter than its header says.
Result<HostTensor> readNpy(const std::string& path);

// Writes `tensor` (float32 or int64) as a version 1.0 .npy file. kInvalidArgument (dtype, byte
// count), kUnavailable (I/O).
Status writeNpy(const std::string& path, const HostTensor& tensor);

// Features [N, F] float32 and targets: int64 [N] class labels or float32 [N, K]. Both files are
// read into memory. kInvalidArgument when the row counts differ or the shapes are not those.
Result<std::unique_ptr<Dataset>> openNpyDataset(const std::string& features_path,
                                                const std::string& targets_path);

}  // namespace troupe::actors
