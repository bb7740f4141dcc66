// Actors as real processes: a real redis-server, controller, node agents and workers, driven
// through the C++ client API over loopback sockets.
#include <doctest/doctest.h>

#include "troupe/testing/cluster_fixture.h"
#include <fstream>

#include "troupe/actors/init_args.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/rpc.h"

namespace troupe {
namespace {

using testing::Cluster;
using testing::eventually;

// `type`'s init args as a driver encodes them from JSON (actors/schema/init_args.capnp).
std::string initArgs(std::string_view type, std::string_view json) {
  auto encoded = actors::encodeInitArgs(type, json);
  REQUIRE(encoded.isOk());
  return *encoded;
}

// A cluster of `nodes` node agents (2 CPUs each) and a connected client.
struct ActorCluster {
  Cluster cluster{1000};
  std::vector<NodeId> nodes;
  kj::Own<ClusterClient> client;
  explicit ActorCluster(int n = 1, double cpus = 2) {
    cluster.startController();
    for (int i = 0; i < n; ++i) nodes.push_back(cluster.startNode(cpus, "ssd=1"));
    client = ClusterClient::connect(io(), cluster.controllerAddress(), cluster.token()).wait(io().waitScope);
  }
  kj::AsyncIoContext& io() { return cluster.io(); }
  template <typename T>
  T wait(kj::Promise<T>&& p) {
    return p.wait(io().waitScope);
  }
  void wait(kj::Promise<void>&& p) { p.wait(io().waitScope); }
  // The error description of a promise expected to fail.
  template <typename T>
  std::string error(kj::Promise<T>&& p) {
    std::string out = "(no error)";
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { p.wait(io().waitScope); })) { out = e->getDescription().cStr(); }
    return out;
  }
  // The status (code and message) of a promise expected to fail.
  template <typename T>
  Status status(kj::Promise<T>&& p) {
    Status out;
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { p.wait(io().waitScope); })) { out = statusFromException(*e, ""); }
    return out;
  }
  // Runs the real CLI against this cluster; returns its stdout+stderr.
  std::string troupe(std::vector<std::string> args) {
    std::string out = (cluster.runDir() / ("cli-" + randomHex(4) + ".out")).string();
    SpawnOptions o;
    o.argv = {testing::binDir() + "/troupe"};
    o.argv.insert(o.argv.end(), args.begin(), args.end());
    o.argv.insert(o.argv.end(), {"--address", cluster.controllerAddress().toString(), "--token", cluster.token()});
    o.outputPath = out;
    ChildProcess cli(*spawnProcess(o));
    auto exit = cli.wait(std::chrono::seconds(20));
    REQUIRE(exit.has_value());
    std::ifstream in(out);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  ActorOptions options(const std::string& type, double cpus = 1) {
    ActorOptions o;
    o.type = type;
    o.resources = {{"CPU", cpus}};
    return o;
  }
};

TEST_CASE("actors: calls from one caller run in order, pipelined, with results as futures") {
  ActorCluster c;
  auto counter = c.wait(c.client->createActor(c.options("Counter")));
  CHECK(c.wait(counter.call("add", "5")) == "5");
  // 200 calls in flight at once; each result is the running sum, so any reordering shows.
  auto results = kj::heapArrayBuilder<kj::Promise<std::string>>(200);
  for (int i = 0; i < 200; ++i) results.add(counter.call("add", "1"));
  auto values = c.wait(kj::joinPromises(results.finish()));
  for (int i = 0; i < 200; ++i) CHECK(values[i] == std::to_string(6 + i));
  // The typed interface shares the counter with the generic calls.
  auto typed = c.wait(counter.typed<rpc::Counter>());
  auto request = typed.addRequest();
  request.setDelta(10);
  CHECK(c.wait(request.send()).getValue() == 215);
  // A method error reaches the caller; the actor keeps working.
  CHECK(c.error(counter.call("add", "x")).find("must be an integer") != std::string::npos);
  CHECK(c.wait(counter.call("get")) == "215");
}

TEST_CASE("actors: echo carries binary payloads of every size") {
  ActorCluster c;
  auto echo = c.wait(c.client->createActor(c.options("Echo")));
  // Sizes from 64 KiB are sent from the caller's buffer (not copied into the message), whole
  // 8-byte words at a time; the odd sizes check that the padding stays out of the bytes. 100 MB
  // is over Cap'n Proto's default 64 MiB message limit.
  for (size_t size : {size_t(0), size_t(1), size_t(4096), size_t(1) << 20, (size_t(1) << 20) + 3, size_t(65536) + 7,
                      size_t(100) << 20}) {
    std::string payload(size, '\0');
    for (size_t i = 0; i < size; ++i) payload[i] = static_cast<char>(i * 7);
    std::string expected = payload;
    auto reply = c.wait(echo.call("echo", std::move(payload)));
    CHECK(reply.size() == size);
    CHECK(reply == expected);
  }
  // Past the bound (kMaxRpcMessageBytes) a call fails with an error that says so.
  std::string huge(troupe::kMaxRpcMessageBytes + 8, 'h');
  auto tooBig = echo.call("echo", std::move(huge)).then([](std::string) { return std::string("sent"); },
                                                        [](kj::Exception&& e) { return std::string(e.getDescription().cStr()); });
  std::string why = c.wait(kj::mv(tooBig));
  CAPTURE(why);
  CHECK(why.find("larger than") != std::string::npos);
}

TEST_CASE("actors: named lookup, handles by id, kill, and unknown types") {
  ActorCluster c;
  auto o = c.options("Counter");
  o.name = "shared-counter";
  o.initArgs = initArgs("Counter", R"({"start": 100})");
  auto created = c.wait(c.client->createActor(o));
  auto found = c.wait(c.client->getActor("shared-counter"));
  CHECK(found.id() == created.id());
  CHECK(c.wait(found.call("add", "1")) == "101");
  auto byId = c.client->actor(created.id());  // as another process would get it
  CHECK(c.wait(byId.call("get")) == "101");
  CHECK(c.error(c.client->createActor(o)).find("already exists") != std::string::npos);

  c.wait(c.client->kill(created));
  std::string err = c.error(byId.call("get"));
  CHECK(err.find("died") != std::string::npos);
  CHECK(err.find("killed on request") != std::string::npos);
  CHECK(c.error(c.client->getActor("shared-counter")).find("no live actor") != std::string::npos);
  auto info = c.wait(c.client->actorInfo(created.id()));
  CHECK(info.state == ActorState::kDead);

  CHECK(c.error(c.client->createActor(c.options("NoSuchType"))).find("unknown actor type") != std::string::npos);
}

TEST_CASE("actors: lifetime: a client's actors end with it unless detached") {
  ActorCluster c;
  ActorId owned, detached;
  {
    auto driver = c.wait(ClusterClient::connect(c.io(), c.cluster.controllerAddress(), c.cluster.token()));
    owned = c.wait(driver->createActor(c.options("Counter", 0.5))).id();
    auto o = c.options("Counter", 0.5);
    o.detached = true;
    detached = c.wait(driver->createActor(o)).id();
  }  // the driver goes away
  CHECK(eventually(std::chrono::seconds(5), [&]() {
    return c.wait(c.client->actorInfo(owned)).state == ActorState::kDead;
  }));
  CHECK(c.wait(c.client->actorInfo(owned)).deathReason.find("owner") != std::string::npos);
  CHECK(c.wait(c.client->actorInfo(detached)).state == ActorState::kAlive);
  CHECK(c.wait(c.client->actor(detached).call("add", "2")) == "2");
}

TEST_CASE("actors: a handle passed to another actor (as its id) works there") {
  ActorCluster c;
  auto counter = c.wait(c.client->createActor(c.options("Counter", 0.5)));
  auto relay = c.wait(c.client->createActor(c.options("Relay", 0.5)));
  CHECK(c.wait(relay.call("relay", counter.id().hex() + " add 7")) == "7");
  CHECK(c.wait(relay.call("relay", counter.id().hex() + " add 1")) == "8");
  CHECK(c.wait(counter.call("get")) == "8");
  CHECK(c.error(relay.call("relay", counter.id().hex() + " add nope")).find("must be an integer") != std::string::npos);
}

TEST_CASE("actors: a method's status code reaches the caller across workers; a callee's death is not the caller's") {
  ActorCluster c;
  auto counter = c.wait(c.client->createActor(c.options("Counter", 0.5)));
  auto relay = c.wait(c.client->createActor(c.options("Relay", 0.5)));
  // Directly, and several at once (which may travel as one batch).
  Status direct = c.status(counter.call("add", "x"));
  CHECK_MESSAGE(direct.code() == StatusCode::kInvalidArgument, direct.toString());
  CHECK(direct.message().find("must be an integer") != std::string::npos);
  CHECK(direct.message().find('[') == std::string::npos);  // the code is not left in the words
  auto many = kj::heapArrayBuilder<kj::Promise<std::string>>(5);
  for (int i = 0; i < 5; ++i) many.add(counter.call("add", "y"));
  for (auto& p : many.finish()) {
    Status s = c.status(kj::mv(p));
    CHECK_MESSAGE(s.code() == StatusCode::kInvalidArgument, s.toString());
  }
  // Through another actor: two RPC edges.
  Status relayed = c.status(relay.call("relay", counter.id().hex() + " add nope"));
  CHECK_MESSAGE(relayed.code() == StatusCode::kInvalidArgument, relayed.toString());
  // The relay's callee dies: the caller hears UNAVAILABLE from the live relay, ACTOR_DIED only
  // from the dead actor itself.
  auto mortal = c.wait(c.client->createActor(c.options("Crasher", 0.5)));
  Status died = c.status(mortal.call("exit", "3"));
  CHECK_MESSAGE(died.code() == StatusCode::kActorDied, died.toString());
  Status viaRelay = c.status(relay.call("relay", mortal.id().hex() + " ping -"));
  CHECK_MESSAGE(viaRelay.code() == StatusCode::kUnavailable, viaRelay.toString());
  CHECK(viaRelay.message().find("died") != std::string::npos);
  CHECK(c.wait(relay.call("relay", counter.id().hex() + " add 0")) == "0");  // the relay lives on
}

TEST_CASE("actors: a segfault is reported with SIGSEGV and the last stderr line; max_restarts brings it back") {
  ActorCluster c;
  auto mortal = c.wait(c.client->createActor(c.options("Crasher")));
  std::string err = c.error(mortal.call("segfault"));
  CHECK(err.find("SIGSEGV") != std::string::npos);
  CHECK(err.find("about to dereference a null pointer") != std::string::npos);
  CHECK(err.find("died") != std::string::npos);
  // Later calls fail with the same reason, not a bare "disconnected".
  CHECK(c.error(mortal.call("ping")).find("SIGSEGV") != std::string::npos);
  auto dead = c.wait(c.client->actorInfo(mortal.id()));
  CHECK(dead.state == ActorState::kDead);
  // The CLI shows why, and its captured stderr.
  CHECK(c.troupe({"logs", mortal.id().hex()}).find("about to dereference a null pointer") != std::string::npos);
  std::string status = c.troupe({"status", "--json"});
  for (const char* key : {"\"id\"", "\"type\":\"Crasher\"", "\"node_id\"", "\"pid\"", "\"state\":\"DEAD\"",
                          "\"restarts\"", "\"death_reason\"", "SIGSEGV", "\"name\""}) {
    CHECK_MESSAGE(status.find(key) != std::string::npos, key);
  }

  auto o = c.options("Crasher");
  o.maxRestarts = 2;
  auto phoenix = c.wait(c.client->createActor(o));
  std::string firstPid = c.wait(phoenix.call("whoami"));
  CHECK(c.error(phoenix.call("abort")).find("SIGABRT") != std::string::npos);
  // The same handle works on the new incarnation.
  std::string secondPid = c.wait(phoenix.call("whoami"));
  CHECK(secondPid != firstPid);
  CHECK(secondPid.find(" 2 ") != std::string::npos);  // incarnation 2
  auto info = c.wait(c.client->actorInfo(phoenix.id()));
  CHECK(info.restarts == 1);
  CHECK(info.state == ActorState::kAlive);
  CHECK(info.deathReason.find("SIGABRT") != std::string::npos);

  // With max_task_retries the failed call itself is retried on the next incarnation.
  o.maxTaskRetries = 1;
  o.maxRestarts = 1;
  auto retried = c.wait(c.client->createActor(o));
  CHECK(c.error(retried.call("exit", "7")).find("exited with code 7") != std::string::npos);
}

TEST_CASE("actors: a worker that fails in its constructor is reported with its message") {
  ActorCluster c;
  auto o = c.options("Crasher");
  o.initArgs = initArgs("Crasher", R"({"fail_on_start": true})");
  std::string err = c.error(c.client->createActor(o));
  CHECK(err.find("exited with code 1") != std::string::npos);
  CHECK(err.find("fail_on_start") != std::string::npos);
}

TEST_CASE("actors: init args that are not their type's message stop the worker, named") {
  ActorCluster c;
  auto o = c.options("Counter");
  o.initArgs = "100";  // a decimal start value: the contract before actors/schema/init_args.capnp
  std::string err = c.error(c.client->createActor(o));
  CAPTURE(err);
  CHECK(err.find("Counter init args (3 bytes) are not a CounterArgs message") != std::string::npos);
}

TEST_CASE("actors: killing a node agent moves restartable actors to another node") {
  ActorCluster c(2, 2);
  auto o = c.options("Counter", 2);  // fills one node
  o.maxRestarts = -1;
  o.maxTaskRetries = 1;  // a call racing with the node's death goes to the next incarnation
  auto restartable = c.wait(c.client->createActor(o));
  auto before = c.wait(c.client->actorInfo(restartable.id()));
  size_t victim = before.nodeId == c.nodes[0] ? 0 : 1;
  c.cluster.nodeProcesses()[victim].stop(SIGKILL, std::chrono::seconds(5));
  // Its worker dies with its agent; the controller notices the node and restarts the actor.
  CHECK(c.wait(restartable.call("whoami")).find(" 2 ") != std::string::npos);
  auto after = c.wait(c.client->actorInfo(restartable.id()));
  CHECK(after.nodeId == c.nodes[1 - victim]);
  CHECK(after.deathReason.find("node") != std::string::npos);
  CHECK(after.restarts == 1);
}

TEST_CASE("actors: placement groups, every strategy, atomic, resizable, infeasible") {
  ActorCluster c(2, 2);
  auto spread = c.wait(c.client->createPlacementGroup(PlacementStrategy::kStrictSpread, {{{"CPU", 1}}, {{"CPU", 1}}}));
  CHECK(spread.state == PlacementGroupState::kCreated);
  CHECK(spread.bundles[0].nodeId != spread.bundles[1].nodeId);
  auto pack = c.wait(c.client->createPlacementGroup(PlacementStrategy::kStrictPack, {{{"CPU", 1}}, {{"CPU", 1}}}));
  // One CPU is left on each node: STRICT_PACK of two waits, atomically (no half reservation).
  CHECK(pack.state == PlacementGroupState::kPending);
  CHECK_FALSE(pack.pendingReason.empty());
  auto loose = c.wait(c.client->createPlacementGroup(PlacementStrategy::kPack, {{{"CPU", 1}}}));
  CHECK(loose.state == PlacementGroupState::kCreated);
  auto spreadLoose = c.wait(c.client->createPlacementGroup(PlacementStrategy::kSpread, {{{"CPU", 1}}}));
  CHECK(spreadLoose.state == PlacementGroupState::kCreated);
  std::string infeasible = c.error(c.client->createPlacementGroup(PlacementStrategy::kPack, {{{"CPU", 16}}}));
  CHECK(infeasible.find("infeasible") != std::string::npos);

  // An actor in bundle 1 of the spread group runs on that bundle's node.
  auto o = c.options("Counter");
  o.placementGroup = spread.id;
  o.bundleIndex = 1;
  auto member = c.wait(c.client->createActor(o));
  CHECK(c.wait(c.client->actorInfo(member.id())).nodeId == spread.bundles[1].nodeId);

  // Shrink: remove bundle 0; bundle 1 and its actor keep running.
  auto shrunk = c.wait(c.client->removeBundles(spread.id, {0}));
  CHECK(shrunk.bundles[0].resources.empty());
  CHECK(c.wait(member.call("add", "1")) == "1");
  // Free the loose groups; the pending STRICT_PACK group becomes CREATED on its own.
  c.wait(c.client->removePlacementGroup(loose.id));
  c.wait(c.client->removePlacementGroup(spreadLoose.id));
  CHECK(eventually(std::chrono::seconds(5), [&]() {
    return c.wait(c.client->placementGroup(pack.id)).state == PlacementGroupState::kCreated;
  }));
  // Grow the spread group again: all or nothing, on a node other than bundle 1's... none is free.
  auto grown = c.error(c.client->addBundles(shrunk, {{{"CPU", 1}}}));
  CHECK(grown.find("pending") != std::string::npos);
  CHECK(c.wait(c.client->placementGroup(spread.id)).bundles.size() == 2);
  c.wait(c.client->removePlacementGroup(pack.id));
  auto regrown = c.wait(c.client->addBundles(shrunk, {{{"CPU", 1}}}));
  CHECK(regrown.bundles.size() == 3);
  CHECK(regrown.bundles[2].nodeId != regrown.bundles[1].nodeId);
  c.wait(c.client->removePlacementGroup(spread.id));
  CHECK(c.error(member.call("get")).find("died") != std::string::npos);
}

// Calls every controller method twice with the same arguments over raw Cap'n Proto: the second
// call must succeed and change nothing.
TEST_CASE("controller RPC handlers are idempotent") {
  ActorCluster c;
  auto rpc = RpcClient::connect(c.io(), c.cluster.controllerAddress(), c.cluster.token(), 5 * kj::SECONDS)
                 .wait(c.io().waitScope);
  auto controller = rpc->bootstrap<rpc::Controller>();
  auto& ws = c.io().waitScope;
  auto twice = [&](auto makeRequest) {
    auto first = makeRequest().send().wait(ws);
    auto second = makeRequest().send().wait(ws);
    return std::make_pair(kj::mv(first), kj::mv(second));
  };
  twice([&]() { return controller.pingRequest(); });
  twice([&]() { return controller.statusRequest(); });

  std::string id = ActorId::generate().hex();
  auto [a1, a2] = twice([&]() {
    auto r = controller.createActorRequest();
    r.setId(id);
    auto spec = r.initSpec();
    spec.setType("Counter");
    spec.setName("idem");
    auto res = spec.initResources(1);
    res[0].setName("CPU");
    res[0].setQuantity(1);
    return r;
  });
  CHECK(std::string(a1.getActor().getId().cStr()) == std::string(a2.getActor().getId().cStr()));
  auto alive = twice([&]() {
    auto r = controller.waitActorRequest();
    r.setId(id);
    r.setMinIncarnation(1);
    r.setTimeoutMs(10000);
    return r;
  });
  CHECK(std::string(alive.second.getActor().getState().cStr()) == "ALIVE");
  std::string address = alive.second.getActor().getAddress().cStr();
  twice([&]() {
    auto r = controller.actorReadyRequest();
    r.setId(id);
    r.setIncarnation(1);
    r.setAddress(address);
    r.setPid(alive.second.getActor().getPid());
    return r;
  });
  auto named = twice([&]() {
    auto r = controller.getActorByNameRequest();
    r.setName("idem");
    return r;
  });
  CHECK(std::string(named.second.getActor().getId().cStr()) == id);
  auto [g1, g2] = twice([&]() {
    auto r = controller.createPlacementGroupRequest();
    r.setId("00000000000000aa");
    r.setStrategy("PACK");
    auto b = r.initBundles(1)[0].initResources(1);
    b[0].setName("CPU");
    b[0].setQuantity(1);
    return r;
  });
  CHECK(g2.getGroup().getBundles().size() == 1);
  auto grown = twice([&]() {
    auto r = controller.addBundlesRequest();
    r.setId("00000000000000aa");
    r.setFromIndex(1);
    auto b = r.initBundles(1)[0].initResources(1);
    b[0].setName("ssd");
    b[0].setQuantity(1);
    return r;
  });
  CHECK(grown.second.getGroup().getBundles().size() == 2);
  twice([&]() {
    auto r = controller.removeBundlesRequest();
    r.setId("00000000000000aa");
    r.initIndices(1).set(0, 1);
    return r;
  });
  twice([&]() {
    auto r = controller.getPlacementGroupRequest();
    r.setId("00000000000000aa");
    return r;
  });
  twice([&]() {
    auto r = controller.removePlacementGroupRequest();
    r.setId("00000000000000aa");
    return r;
  });
  twice([&]() {
    auto r = controller.workerExitedRequest();
    r.setId(id);
    r.setIncarnation(99);  // a stale report: ignored both times
    return r;
  });
  twice([&]() {
    auto r = controller.killActorRequest();
    r.setId(id);
    r.setNoRestart(true);
    return r;
  });
  auto dead = controller.waitActorRequest();
  dead.setId(id);
  CHECK(std::string(dead.send().wait(ws).getActor().getState().cStr()) == "DEAD");
  // registerNode twice for the same node keeps one record.
  auto statusReply = controller.statusRequest().send().wait(ws);
  auto nodes = statusReply.getNodes();
  REQUIRE(nodes.size() == 1);
  twice([&]() {
    auto r = controller.registerNodeRequest();
    r.setNode(nodes[0]);
    return r;
  });
  CHECK(controller.statusRequest().send().wait(ws).getNodes().size() == 1);

  // Group records: an event sent twice (a retry) is one line.
  twice([&]() {
    auto r = controller.putGroupRequest();
    r.setId("g-twice");
    r.setDoc("{}");
    return r;
  });
  twice([&]() {
    auto r = controller.groupEventRequest();
    r.setId("g-twice");
    r.setText("resized to 2");
    r.setTimeMs(1234);
    return r;
  });
  // A command sent twice with its nonce (a retry) is one command, and both calls get its seq.
  auto commanded = twice([&]() {
    auto r = controller.groupCommandRequest();
    r.setId("g-twice");
    r.initCommand().setResize(3);
    r.setNonce("nonce-1");
    return r;
  });
  CHECK(commanded.first.getSeq() == 1);
  CHECK(commanded.second.getSeq() == 1);
  auto group = controller.getGroupRequest();
  group.setId("g-twice");
  auto reply = group.send().wait(ws);
  auto events = reply.getGroup().getEvents();
  REQUIRE(events.size() == 1);
  CHECK(std::string(events[0].cStr()) == "1234 resized to 2");
  auto commands = reply.getGroup().getCommands();
  REQUIRE(commands.size() == 1);
  CHECK(commands[0].getSeq() == 1);
  REQUIRE(commands[0].isResize());
  CHECK(commands[0].getResize() == 3);
  CHECK(commands[0].getTimeMs() > 0);  // 0 sent: the controller's clock
  twice([&]() {
    auto r = controller.removeGroupRequest();
    r.setId("g-twice");
    return r;
  });
  // A command to the removed group is refused with NOT_FOUND, not dropped.
  auto late = controller.groupCommandRequest();
  late.setId("g-twice");
  late.initCommand().setStop();
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { late.send().wait(ws); })) {
    CHECK(statusFromException(*e, "groupCommand").code() == StatusCode::kNotFound);
  } else {
    FAIL("a command to a removed group was accepted");
  }
}

}  // namespace
}  // namespace troupe
