#include "checkpoint_options.h"

#include <sys/stat.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "troupe/actors/init_args.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/rpc.h"

namespace troupe::actors::checkpoint_actor {
namespace {

constexpr size_t kMaxErrors = 10;  // recent errors kept for status

}  // namespace

std::string Options::primary(uint32_t rank) const {
  return *ck::segmentName(group, node, ck::SegmentKind::kPrimary, rank);
}

std::string Options::replica(uint32_t rank) const {
  return *ck::segmentName(group, node, ck::SegmentKind::kReplica, rank);
}

ck::SegmentOptions Options::segment(const std::string& name) const {
  ck::SegmentOptions o;
  o.dir = shmDir;
  o.name = name;
  o.fault = fault;
  return o;
}

ck::DirectoryOptions Options::directory(const std::atomic<bool>* stop) const {
  ck::DirectoryOptions o;
  o.path = dir;
  o.keep = keep;
  o.fault = fault;
  o.stop = stop;
  o.fileMode = fileMode;
  return o;
}

Status badArgs(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "Checkpoint actor: " + what);
}

Result<Options> parseOptions(std::string_view initArgs) {
  TROUPE_ASSIGN_OR_RETURN(auto init, decodeInitArgs<rpc::CheckpointArgs>("Checkpoint", initArgs));
  auto args = init.get();
  Options o;
  o.group = args.getGroup().cStr();
  o.node = args.getNode().cStr();
  o.self = args.getSelf().cStr();
  for (auto member : args.getMembers()) o.members.emplace_back(member.cStr());
  o.dir = args.getDir().cStr();
  o.fileMode = args.getFileMode();
  if ((o.fileMode & ~0777u) != 0 || (o.fileMode & 0600u) != 0600u) {
    return badArgs(fmt::format("\"file_mode\" {:o} must be a permission mode that lets its owner read and write",
                               o.fileMode));
  }
  o.keep = args.getKeep();
  o.shmDir = args.getShmDir().size() > 0 ? args.getShmDir().cStr() : ck::defaultShmDir();
  if (args.hasReplicaTo()) {
    o.replicaTo = args.getReplicaTo().cStr();
  } else if (o.members.size() > 1) {
    auto it = std::find(o.members.begin(), o.members.end(), o.self);
    if (it == o.members.end()) return badArgs("\"self\" must be one of \"members\" to pick a replica target");
    o.replicaTo = *(++it == o.members.end() ? o.members.begin() : it);
  }
  TROUPE_ASSIGN_OR_RETURN(auto fault, ck::FaultInjection::parse(args.getFault().cStr()));
  o.fault = fault;
  TROUPE_ASSIGN_OR_RETURN(auto name, ck::segmentName(o.group, o.node, ck::SegmentKind::kPrimary, 0));
  if (o.replicaTo == o.self && !o.replicaTo.empty()) return badArgs("an actor cannot keep its own replicas");
  return o;
}

Status statusOf(const kj::Exception& e) { return statusFromException(e, ""); }

void RecentErrors::add(std::string error) {
  TROUPE_LOG(kWarning, "{}", error);
  errors_.push_back(std::move(error));
  if (errors_.size() > kMaxErrors) errors_.erase(errors_.begin());
}

void TaskErrorLog::taskFailed(kj::Exception&& e) {
  TROUPE_LOG(kWarning, "checkpoint actor task failed: {}", e.getDescription().cStr());
}

Result<std::shared_ptr<ck::FlashSegment>> SegmentCache::get(const std::string& name) {
  struct stat st {};
  std::string path = (options_.shmDir.empty() ? ck::defaultShmDir() : options_.shmDir) + "/" + name;
  if (::stat(path.c_str(), &st) != 0) {
    entries_.erase(name);
    return Status(StatusCode::kNotFound, fmt::format("no checkpoint segment {}", path));
  }
  auto it = entries_.find(name);
  if (it != entries_.end() && it->second.ino == st.st_ino && it->second.dev == st.st_dev) return it->second.segment;
  TROUPE_ASSIGN_OR_RETURN(auto segment, ck::FlashSegment::openExisting(options_.segment(name)));
  auto shared = std::make_shared<ck::FlashSegment>(std::move(segment));
  entries_[name] = Entry{shared, st.st_dev, st.st_ino};
  return shared;
}

}  // namespace troupe::actors::checkpoint_actor
