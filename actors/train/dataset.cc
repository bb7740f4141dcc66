#include "troupe/actors/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace troupe::actors {
namespace {

Status ioError(const std::string& what, const std::string& path) {
  const int error = errno;
  return Status(error == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                fmt::format("{} {}: {}", what, path, std::strerror(error)));
}

// A read-only mapping of a whole file, unmapped and closed by the destructor.
class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ioError("cannot open", path);
    auto file = std::unique_ptr<MappedFile>(new MappedFile(fd));
    struct stat st {};
    if (::fstat(fd, &st) != 0) return ioError("cannot stat", path);
    file->size_ = static_cast<size_t>(st.st_size);
    if (file->size_ > 0) {
      void* data = ::mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
      if (data == MAP_FAILED) return ioError("cannot map", path);
      file->data_ = static_cast<const uint8_t*>(data);
    }
    return file;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
    ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  explicit MappedFile(int fd) : fd_(fd) {}
  int fd_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

size_t tokenSize(const std::string& token_type) {
  if (token_type == "uint16") return 2;
  if (token_type == "uint32") return 4;
  return 0;
}

Status badTokenType(const std::string& token_type) {
  return Status(StatusCode::kInvalidArgument,
                fmt::format("token type '{}' is not supported: use uint16 or uint32", token_type));
}

Status idOutOfRange(uint64_t id, uint64_t size, const std::string& what) {
  return Status(StatusCode::kInvalidArgument,
                fmt::format("sample id {} is out of range for {} ({} samples)", id, what, size));
}

class TokenDataset final : public Dataset {
 public:
  TokenDataset(TokenDatasetOptions options, std::unique_ptr<MappedFile> file, size_t token_size)
      : options_(std::move(options)), file_(std::move(file)), token_size_(token_size) {
    tokens_ = file_->size() / token_size_;
    samples_ = (tokens_ - 1) / static_cast<uint64_t>(options_.context);
  }

  uint64_t size() const override { return samples_; }

  Result<Batch> batch(const std::vector<uint64_t>& ids) const override {
    const int64_t t = options_.context;
    const int64_t b = static_cast<int64_t>(ids.size());
    Batch batch;
    batch.inputs.dtype = batch.targets.dtype = "int64";
    batch.inputs.shape = batch.targets.shape = {b, t};
    batch.inputs.bytes.resize(static_cast<size_t>(b * t) * 8);
    batch.targets.bytes.resize(static_cast<size_t>(b * t) * 8);
    auto* inputs = reinterpret_cast<int64_t*>(batch.inputs.bytes.data());
    auto* targets = reinterpret_cast<int64_t*>(batch.targets.bytes.data());
    for (int64_t i = 0; i < b; ++i) {
      const uint64_t id = ids[static_cast<size_t>(i)];
      if (id >= samples_) return idOutOfRange(id, samples_, describe());
      const uint64_t start = id * static_cast<uint64_t>(t);
      for (int64_t j = 0; j <= t; ++j) {
        const int64_t token = tokenAt(start + static_cast<uint64_t>(j));
        if (j < t) inputs[i * t + j] = token;
        if (j > 0) targets[i * t + j - 1] = token;
      }
    }
    batch.sample_ids = ids;
    return batch;
  }

  std::string describe() const override {
    return fmt::format("token file {} ({} {} tokens, context {}: {} samples)", options_.path,
                       tokens_, options_.token_type, options_.context, samples_);
  }

 private:
  int64_t tokenAt(uint64_t index) const {
    const uint8_t* p = file_->data() + index * token_size_;
    if (token_size_ == 2) {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }

  TokenDatasetOptions options_;
  std::unique_ptr<MappedFile> file_;
  size_t token_size_;
  uint64_t tokens_ = 0;
  uint64_t samples_ = 0;
};

// ---- .npy header: a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : text_(text) {}

  Status parse(NpyHeader& header) {
    bool have_descr = false, have_order = false, have_shape = false;
    skipSpace();
    if (!consume('{')) return error("expected '{' at the start of the header dict");
    for (;;) {
      skipSpace();
      if (consume('}')) break;
      std::string key;
      TROUPE_RETURN_IF_ERROR(quoted(key));
      skipSpace();
      if (!consume(':')) return error(fmt::format("expected ':' after key '{}'", key));
      skipSpace();
      if (key == "descr") {
        std::string descr;
        TROUPE_RETURN_IF_ERROR(quoted(descr));
        if (descr == "<f4") {
          header.dtype = "float32";
        } else if (descr == "<i8") {
          header.dtype = "int64";
        } else {
          return error(fmt::format("dtype '{}' is not supported: save float32 ('<f4') or int64 "
                                   "('<i8') little-endian arrays",
                                   descr));
        }
        have_descr = true;
      } else if (key == "fortran_order") {
        if (word("False")) {
          have_order = true;
        } else if (word("True")) {
          return error("fortran_order is True: save a C-order array (np.ascontiguousarray)");
        } else {
          return error("fortran_order must be True or False");
        }
      } else if (key == "shape") {
        TROUPE_RETURN_IF_ERROR(shape(header.shape));
        have_shape = true;
      } else {
        return error(fmt::format("unexpected key '{}'", key));
      }
      skipSpace();
      if (consume(',')) continue;
      skipSpace();
      if (consume('}')) break;
      return error(fmt::format("expected ',' or '}}' after the value of '{}'", key));
    }
    if (!have_descr) return error("the key 'descr' is missing");
    if (!have_order) return error("the key 'fortran_order' is missing");
    if (!have_shape) return error("the key 'shape' is missing");
    return Status::ok();
  }

 private:
  void skipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\t')) {
      ++pos_;
    }
  }
  bool consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool word(std::string_view w) {
    if (text_.substr(pos_, w.size()) == w) {
      pos_ += w.size();
      return true;
    }
    return false;
  }
  Status quoted(std::string& out) {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return error("expected a quoted string");
    }
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == std::string_view::npos) return error("unterminated string");
    out = std::string(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return Status::ok();
  }
  Status shape(std::vector<int64_t>& dims) {
    if (!consume('(')) return error("shape must be a tuple such as (3, 4)");
    for (;;) {
      skipSpace();
      if (consume(')')) return Status::ok();
      const size_t start = pos_;
      int64_t value = 0;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        if (value > (int64_t{1} << 50)) return error("a dimension in shape is too large");
        value = value * 10 + (text_[pos_++] - '0');
      }
      if (pos_ == start) return error("shape must hold non-negative integers");
      // Python 2 era files may write 3L.
      consume('L');
      dims.push_back(value);
      skipSpace();
      if (consume(',')) continue;
      skipSpace();
      if (consume(')')) return Status::ok();
      return error("expected ',' or ')' in shape");
    }
  }
  Status error(const std::string& what) const {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format(".npy header: {} (at offset {} of the header text '{}')", what, pos_,
                              std::string(text_.substr(0, 120))));
  }

  std::string_view text_;
  size_t pos_ = 0;
};

Result<std::string> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    errno = ENOENT;
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) errno = EACCES;
    return ioError("cannot open", path);
  }
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

class NpyDataset final : public Dataset {
 public:
  NpyDataset(std::string features_path, std::string targets_path, HostTensor features,
             HostTensor targets)
      : features_path_(std::move(features_path)),
        targets_path_(std::move(targets_path)),
        features_(std::move(features)),
        targets_(std::move(targets)) {}

  uint64_t size() const override { return static_cast<uint64_t>(features_.shape[0]); }

  Result<Batch> batch(const std::vector<uint64_t>& ids) const override {
    Batch batch;
    TROUPE_RETURN_IF_ERROR(gather(features_, ids, batch.inputs));
    TROUPE_RETURN_IF_ERROR(gather(targets_, ids, batch.targets));
    batch.sample_ids = ids;
    return batch;
  }

  std::string describe() const override {
    return fmt::format(".npy features {} {} [{}] and targets {} {} [{}]: {} samples",
                       features_path_, features_.dtype, fmt::join(features_.shape, ", "),
                       targets_path_, targets_.dtype, fmt::join(targets_.shape, ", "), size());
  }

 private:
  Status gather(const HostTensor& from, const std::vector<uint64_t>& ids, HostTensor& to) const {
    const size_t row = from.bytes.size() / static_cast<size_t>(from.shape[0]);
    to.dtype = from.dtype;
    to.shape = from.shape;
    to.shape[0] = static_cast<int64_t>(ids.size());
    to.bytes.resize(row * ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= size()) return idOutOfRange(ids[i], size(), describe());
      std::memcpy(to.bytes.data() + i * row, from.bytes.data() + ids[i] * row, row);
    }
    return Status::ok();
  }

  std::string features_path_;
  std::string targets_path_;
  HostTensor features_;
  HostTensor targets_;
};

}  // namespace

Result<std::unique_ptr<Dataset>> openTokenDataset(const TokenDatasetOptions& options) {
  const size_t token_size = tokenSize(options.token_type);
  if (token_size == 0) return badTokenType(options.token_type);
  if (options.context < 1) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("token dataset: context must be at least 1, got {}", options.context));
  }
  auto file = MappedFile::open(options.path);
  if (!file) return file.status();
  const size_t bytes = (*file)->size();
  if (bytes % token_size != 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("token file {} has {} bytes, not a whole number of {} tokens: is "
                              "the token type right?",
                              options.path, bytes, options.token_type));
  }
  if (bytes / token_size < static_cast<size_t>(options.context) + 1) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("token file {} has {} tokens; a sample needs context + 1 = {}",
                              options.path, bytes / token_size, options.context + 1));
  }
  return std::unique_ptr<Dataset>(
      std::make_unique<TokenDataset>(options, std::move(file).value(), token_size));
}

Result<uint64_t> buildTokenFile(const std::string& text_path, const std::string& token_path,
                                const std::string& token_type) {
  const size_t token_size = tokenSize(token_type);
  if (token_size == 0) return badTokenType(token_type);
  auto text = readFile(text_path);
  if (!text) return text.status();
  std::string out;
  out.reserve(text->size() * token_size);
  for (char c : *text) {
    const auto byte = static_cast<uint8_t>(c);
    out.push_back(static_cast<char>(byte));
    for (size_t i = 1; i < token_size; ++i) out.push_back('\0');  // little-endian high bytes
  }
  const std::string temp = fmt::format("{}.tmp.{}", token_path, ::getpid());
  {
    std::ofstream file(temp, std::ios::binary | std::ios::trunc);
    if (!file) return ioError("cannot create", temp);
    file.write(out.data(), static_cast<std::streamsize>(out.size()));
    file.close();
    if (!file) return ioError("cannot write", temp);
  }
  if (std::rename(temp.c_str(), token_path.c_str()) != 0) {
    Status status = ioError("cannot rename to", token_path);
    std::remove(temp.c_str());
    return status;
  }
  return static_cast<uint64_t>(text->size());
}

Result<NpyHeader> parseNpyHeader(std::string_view start) {
  static constexpr std::string_view kMagic("\x93NUMPY", 6);
  auto bad = [](const std::string& what) {
    return Status(StatusCode::kInvalidArgument, fmt::format(".npy file: {}", what));
  };
  if (start.size() < 10 || start.substr(0, 6) != kMagic) {
    return bad("it does not start with the magic \\x93NUMPY: not a .npy file");
  }
  const auto major = static_cast<uint8_t>(start[6]);
  size_t header_len = 0, preamble = 0;
  if (major == 1) {
    header_len = static_cast<uint8_t>(start[8]) | (static_cast<size_t>(static_cast<uint8_t>(start[9])) << 8);
    preamble = 10;
  } else if (major == 2 || major == 3) {
    if (start.size() < 12) return bad("truncated before the header length");
    for (int i = 0; i < 4; ++i) {
      header_len |= static_cast<size_t>(static_cast<uint8_t>(start[8 + i])) << (8 * i);
    }
    preamble = 12;
  } else {
    return bad(fmt::format("format version {}.{} is not supported (1, 2 or 3)", major,
                           static_cast<int>(static_cast<uint8_t>(start[7]))));
  }
  if (start.size() < preamble + header_len) {
    return bad(fmt::format("the header says it is {} bytes but only {} follow: truncated file",
                           header_len, start.size() - preamble));
  }
  NpyHeader header;
  HeaderParser parser(start.substr(preamble, header_len));
  TROUPE_RETURN_IF_ERROR(parser.parse(header));
  header.data_offset = preamble + header_len;
  return header;
}

Result<HostTensor> readNpy(const std::string& path) {
  auto content = readFile(path);
  if (!content) return content.status();
  auto header = parseNpyHeader(*content);
  if (!header) {
    return Status(header.status().code(), fmt::format("{}: {}", path, header.status().message()));
  }
  HostTensor tensor;
  tensor.dtype = header->dtype;
  tensor.shape = header->shape;
  const size_t expected = static_cast<size_t>(tensor.numel()) * dtypeSize(tensor.dtype);
  const size_t have = content->size() - header->data_offset;
  if (have != expected) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: the header says {} [{}] ({} bytes of data) but the file holds "
                              "{} bytes after the header",
                              path, tensor.dtype, fmt::join(tensor.shape, ", "), expected, have));
  }
  tensor.bytes.assign(content->begin() + static_cast<std::ptrdiff_t>(header->data_offset),
                      content->end());
  return tensor;
}

Status writeNpy(const std::string& path, const HostTensor& tensor) {
  std::string descr;
  if (tensor.dtype == "float32") {
    descr = "<f4";
  } else if (tensor.dtype == "int64") {
    descr = "<i8";
  } else {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("writeNpy: dtype {} is not supported (float32, int64)", tensor.dtype));
  }
  if (tensor.bytes.size() != static_cast<size_t>(tensor.numel()) * dtypeSize(tensor.dtype)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("writeNpy: {} bytes for {} [{}]", tensor.bytes.size(), tensor.dtype,
                              fmt::join(tensor.shape, ", ")));
  }
  // "()", "(5,)", "(3, 4)": Python's tuple syntax.
  std::string shape = fmt::format("({}{})", fmt::join(tensor.shape, ", "),
                                  tensor.shape.size() == 1 ? "," : "");
  std::string dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape);
  // Pad with spaces and a newline so the data starts on a multiple of 64, as NumPy does.
  const size_t total = (10 + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - 10 - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>(dict.size() >> 8));
  out += dict;
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return ioError("cannot create", path);
  file.write(out.data(), static_cast<std::streamsize>(out.size()));
  file.write(reinterpret_cast<const char*>(tensor.bytes.data()),
             static_cast<std::streamsize>(tensor.bytes.size()));
  file.close();
  if (!file) return ioError("cannot write", path);
  return Status::ok();
}

Result<std::unique_ptr<Dataset>> openNpyDataset(const std::string& features_path,
                                                const std::string& targets_path) {
  auto features = readNpy(features_path);
  if (!features) return features.status();
  auto targets = readNpy(targets_path);
  if (!targets) return targets.status();
  if (features->shape.size() < 2 || features->shape[0] == 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: features must be [N, F] with N > 0, got [{}]", features_path,
                              fmt::join(features->shape, ", ")));
  }
  if (targets->shape.empty() || targets->shape[0] != features->shape[0]) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: targets must have one row per sample ({}), got [{}]",
                              targets_path, features->shape[0], fmt::join(targets->shape, ", ")));
  }
  if (targets->dtype == "int64" && targets->shape.size() != 1) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: int64 targets are class labels [N], got [{}]", targets_path,
                              fmt::join(targets->shape, ", ")));
  }
  return std::unique_ptr<Dataset>(std::make_unique<NpyDataset>(
      features_path, targets_path, std::move(features).value(), std::move(targets).value()));
}

}  // namespace troupe::actors
