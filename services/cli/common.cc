#include <fmt/format.h>

#include <deque>
#include <fstream>
#include <iostream>

#include "cli.h"
#include "troupe/runtime/schema_convert.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/safe_open.h"
#include "troupe/runtime/tls.h"

namespace troupe::cli {

int fail(const Status& status) {
  std::cerr << "troupe: error: " << status.message() << std::endl;
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

Result<std::string> readTokenFile(const std::string& path) {
  if (auto own = checkPrivate(path, PathKind::kRegularFile, 077); !own.isOk()) {
    return Status(own.code(), fmt::format("--token-file: {}", own.message()));
  }
  auto read = readRegularFile(path, 4096);  // not through a link or a FIFO swapped in since the check
  if (!read.isOk()) return Status(read.status().code(), fmt::format("--token-file: {}", read.status().message()));
  std::string token = std::move(*read);
  auto isSpace = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!token.empty() && isSpace(token.back())) token.pop_back();
  size_t first = 0;
  while (first < token.size() && isSpace(token[first])) ++first;
  token.erase(0, first);
  if (token.empty()) return Status(StatusCode::kFailedPrecondition, fmt::format("--token-file {} is empty", path));
  return token;
}

Result<ClusterTarget> resolveCluster(const std::string& address, const std::string& token) {
  ClusterTarget target;
  auto runDir = latestRunDir();
  Result<ClusterFile> file = runDir.isOk() ? readClusterFile(*runDir) : Result<ClusterFile>(runDir.status());
  if (!address.empty()) {
    TROUPE_ASSIGN_OR_RETURN(auto hp, parseHostPort(address));
    target.controller = hp;
    target.token = token;
    // The newest run directory on this machine may belong to the same cluster.
    if (file.isOk() && file->controllerAddress == hp.toString()) {
      if (target.token.empty()) target.token = file->token;
      target.runDir = *runDir;
      if (file->tls) tls::require();  // known to be a --tls cluster: never start in plaintext
    }
    if (target.token.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("no cluster token for {}: pass --token-file (a copy of the head's "
                                "<run_dir>/token) or set TROUPE_TOKEN",
                                address));
    }
    return target;
  }
  if (!file.isOk()) return file.status();
  TROUPE_ASSIGN_OR_RETURN(auto hp, parseHostPort(file->controllerAddress));
  target.controller = hp;
  target.token = token.empty() ? file->token : token;
  target.runDir = *runDir;
  if (file->tls) tls::require();
  return target;
}

Result<std::vector<NodeRecord>> fetchNodes(kj::AsyncIoContext& io, const ClusterTarget& target,
                                           kj::Duration timeout) {
  StatusQuery nodesOnly;
  nodesOnly.actors = false;
  TROUPE_ASSIGN_OR_RETURN(auto snapshot, fetchStatus(io, target, timeout, nodesOnly));
  return std::move(snapshot.nodes);
}

Result<ClusterSnapshot> fetchStatus(kj::AsyncIoContext& io, const ClusterTarget& target, kj::Duration timeout,
                                    const StatusQuery& query) {
  ClusterSnapshot snap;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    auto client = RpcClient::connect(io, target.controller, target.token, timeout).wait(io.waitScope);
    auto request = client->bootstrap<rpc::Controller>().statusRequest();
    request.setActors(query.actors);
    request.setActorLimit(query.limit);
    request.setActorOffset(query.offset);
    request.setActorState(query.state);
    request.setActorNode(query.node);
    auto call = request.send();
    auto response = io.provider->getTimer().timeoutAfter(timeout, kj::mv(call)).wait(io.waitScope);
    for (auto node : response.getNodes()) snap.nodes.push_back(fromNodeInfo(node));
    for (auto actor : response.getActors()) snap.actors.push_back(fromActorInfo(actor));
    snap.actorsMatching = response.getActorsMatching();
    for (auto c : response.getActorCounts()) snap.actorCounts[c.getState().cStr()] = c.getCount();
    for (auto group : response.getPlacementGroups()) snap.placementGroups.push_back(fromPlacementGroupInfo(group));
    for (auto g : response.getGroups()) snap.groups.push_back(fromElasticGroupInfo(g));
  })) {
    Status s = statusFromException(*e, "");
    return Status(s.code(), fmt::format("{}; is the cluster running? ('troupe start --head' starts one)",
                                        s.message()));
  }
  return snap;
}

std::string logTail(const std::string& path, int lines) {
  std::ifstream in(path);
  std::deque<std::string> tail;
  std::string line;
  while (std::getline(in, line)) {
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  std::string out;
  for (const auto& l : tail) out += (out.empty() ? "" : " | ") + l;
  return out;
}

}  // namespace troupe::cli
