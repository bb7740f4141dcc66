// The store's Lua scripts (redis_cluster_store.cc runs them). Each may run twice after a lost
// reply (RedisConnection::run retries), so each is written to be safe to repeat. Internal to
// runtime/.
#pragma once

#include <string>

namespace troupe::redis_scripts {

// Defines recomputeUsed(nodeKey, claimsKey): rewrites the node's `used` as the sum of its
// claims, listing every resource in `total` (0 when unclaimed); run when a node (re)registers.
// And addUsed(nodeKey, delta, sign): adds sign * delta (a resources table) to `used`, so a
// claim made or released costs what that claim names, not every claim on the node (a node
// holding 10,000 groups' bundles). A sum that returns to within 1e-9 of zero (relative to the
// node's total) is written as 0, so drift from inexact decimals does not accumulate there.
// The JSON is built by hand because cjson writes numbers with 14 significant digits, which
// would turn a sum of exact claims into a `used` that no longer adds up.
inline constexpr const char* kRecomputeUsedLua = R"lua(
local function writeUsed(nodeKey, used)
  local parts = {}
  for name, amount in pairs(used) do
    table.insert(parts, cjson.encode(name) .. ':' .. string.format('%.17g', amount))
  end
  redis.call('HSET', nodeKey, 'used', '{' .. table.concat(parts, ',') .. '}')
end
local function recomputeUsed(nodeKey, claimsKey)
  local used = {}
  for name, _ in pairs(cjson.decode(redis.call('HGET', nodeKey, 'total') or '{}')) do
    used[name] = 0
  end
  local claims = redis.call('HGETALL', claimsKey)
  for j = 2, #claims, 2 do
    for name, amount in pairs(cjson.decode(claims[j])) do
      used[name] = (used[name] or 0) + amount
    end
  end
  writeUsed(nodeKey, used)
end
local function addUsed(nodeKey, delta, sign)
  local total = cjson.decode(redis.call('HGET', nodeKey, 'total') or '{}')
  local used = cjson.decode(redis.call('HGET', nodeKey, 'used') or '{}')
  for name, _ in pairs(total) do used[name] = used[name] or 0 end
  for name, amount in pairs(delta) do
    local sum = (used[name] or 0) + sign * amount
    if math.abs(sum) <= 1e-9 * math.max(1, total[name] or 0) then sum = 0 end
    used[name] = sum
  end
  writeUsed(nodeKey, used)
end
)lua";

// KEYS: node hash, nodes zset, heartbeat key, claims hash, store-run hash, dead-nodes zset,
// heartbeat-deadlines zset.
// ARGV: ttl ms, registered ms, node id, events channel, NODE_ADDED message, then the hash's
// field/value pairs. Re-registering overwrites every field, so it is idempotent. A node that
// still holds claims (re-registered without restarting) keeps `used` equal to their sum.
inline constexpr const char* kRegisterBody = R"lua(
storeUpMs(KEYS[5])
redis.call('ZREM', KEYS[6], ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
if redis.call('EXISTS', KEYS[4]) == 1 then recomputeUsed(KEYS[1], KEYS[4]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[1])
redis.call('ZADD', KEYS[7], serverMs() + tonumber(ARGV[1]), ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
)lua";

// How long this Redis process has served, as its clients saw it: each run of the server has
// its own run_id, and the first script to see a new one records when. (uptime_in_seconds is
// too coarse, and a restart from the AOF brings back the keys, so they cannot tell.)
inline constexpr const char* kStoreUpLua = R"lua(
local function serverMs()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
local function storeUpMs(runKey)
  local now = serverMs()
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
  local seen = redis.call('HMGET', runKey, 'run_id', 'since_ms')
  if seen[1] ~= run then
    redis.call('HSET', runKey, 'run_id', run, 'since_ms', now)
    return 0
  end
  return now - tonumber(seen[2])
end
)lua";

// Records that node `id` died, and deletes the oldest DEAD nodes beyond `keep` (their hash,
// claims and actor index), so listings and reaps cost what is alive plus a bounded history.
// The actor index's prefix is the claims prefix with node_res: read as node_actors:.
inline constexpr const char* kBuryNodeLua = R"lua(
local function buryNode(deadKey, nodesKey, nodePrefix, claimsPrefix, id, now, keep)
  redis.call('ZADD', deadKey, now, id)
  local extra = redis.call('ZCARD', deadKey) - keep
  if extra > 0 then
    local actorsPrefix = string.gsub(claimsPrefix, 'node_res:$', 'node_actors:')
    for _, old in ipairs(redis.call('ZRANGE', deadKey, 0, extra - 1)) do
      redis.call('DEL', nodePrefix .. old, claimsPrefix .. old, actorsPrefix .. old)
      redis.call('ZREM', nodesKey, old)
    end
    redis.call('ZREMRANGEBYRANK', deadKey, 0, extra - 1)
  end
end
)lua";

// KEYS: node hash, heartbeat key, heartbeat-deadlines zset. ARGV: ttl ms, now ms, node id.
// A node that is unknown or DEAD must not be revived by a late heartbeat: return 0, write nothing.
// Five calls and no INFO: the Redis run is checked by the reap (4 a second), not by every beat
// (333 a second at 1,000 nodes). The deadline (by the server's clock, as the key's expiry) is
// what the reap reads to find the nodes it must look at.
inline constexpr const char* kHeartbeatBody = R"lua(
if redis.call('HGET', KEYS[1], 'state') ~= 'ALIVE' then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
redis.call('HSET', KEYS[1], 'last_heartbeat_ms', ARGV[2], 'heartbeat_ttl_ms', ARGV[1])
local clock = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) + tonumber(ARGV[1]), ARGV[3])
return 1
)lua";

// KEYS: nodes zset, store-run hash, dead-nodes zset, meta hash, heartbeat-deadlines zset.
// ARGV: node hash prefix, heartbeat key prefix, events channel, now ms, claims prefix, DEAD nodes
// to keep. The keys it touches depend on the zsets' contents, so they cannot all be declared in
// KEYS; fine for a single Redis (not Redis Cluster).
// Missed heartbeats are deaths only while the store could take them: a node is judged only
// once this Redis process has served, and reaps have run without a gap of more than 1.5 s,
// for a whole heartbeat TTL. So a Redis restarted from its AOF (expired heartbeat keys come
// back), a stalled Redis (a reap that waited in its queue) and a controller that was away
// leave every node a TTL to beat again. Nodes other than the head's beat through the store
// gateway, which beats too (store_gateway_beat_ms, every 250 ms): while its beat is over 1.5 s
// old (or half a node's TTL, when shorter: a stalled or starved gateway holds every relayed
// beat), and for a TTL after a gap of over 1.5 s, those nodes are not judged.
// Only the nodes whose heartbeat deadline has passed are read (a zset by deadline, kept by the
// heartbeat and register scripts), not every node: a reap costs what expired. The first reap
// on a store without the zset builds it from every ALIVE node.
inline constexpr const char* kReapBody = R"lua(
local now = tonumber(ARGV[4])
local up = storeUpMs(KEYS[2])
local serverNow = serverMs()
local last = tonumber(redis.call('HGET', KEYS[2], 'last_reap_ms'))
local since = tonumber(redis.call('HGET', KEYS[2], 'reaping_since_ms'))
if last == nil or since == nil then since = serverNow - up
elseif serverNow - last > 1500 then since = serverNow end
redis.call('HSET', KEYS[2], 'last_reap_ms', serverNow, 'reaping_since_ms', since)
local judged = math.min(up, serverNow - since)
-- Every node but the head's beats through the store gateway: a restarted gateway gives them a
-- TTL too, and so does one that went quiet.
local gateway = redis.call('HMGET', KEYS[4], 'store_gateway_since_ms', 'store_gateway_beat_ms')
local gatewaySince, gatewayBeat = tonumber(gateway[1]), tonumber(gateway[2])
local judgedRemote = gatewaySince and math.min(judged, serverNow - gatewaySince) or judged
if redis.call('HGET', KEYS[2], 'deadlines') ~= '1' then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    if redis.call('HGET', ARGV[1] .. id, 'state') == 'ALIVE' then
      local left = redis.call('PTTL', ARGV[2] .. id)
      redis.call('ZADD', KEYS[5], serverNow + math.max(left, 0), id)
    end
  end
  redis.call('HSET', KEYS[2], 'deadlines', '1')
end
local dead = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', serverNow)) do
  local nodeKey = ARGV[1] .. id
  local node = redis.call('HMGET', nodeKey, 'state', 'is_head', 'heartbeat_ttl_ms', 'last_heartbeat_ms')
  if node[1] ~= 'ALIVE' then
    redis.call('ZREM', KEYS[5], id)
  else
    -- The gateway is quiet for this node once its beat is older than 1.5 s, or half the node's
    -- TTL when that is shorter: before the node's own beats (every TTL/3) could have expired.
    local ttl = tonumber(node[3]) or 0
    local quiet = gatewayBeat and serverNow - gatewayBeat > math.min(1500, ttl / 2)
    local judgedHere = node[2] == '1' and judged or (quiet and 0 or judgedRemote)
    if redis.call('EXISTS', ARGV[2] .. id) == 0 and judgedHere >= ttl then
      local last = tonumber(node[4]) or now
      local reason = 'missed heartbeats: no heartbeat for ' .. string.format('%d', now - last) ..
                     ' ms (heartbeat TTL expired)'
      redis.call('HSET', nodeKey, 'state', 'DEAD', 'death_reason', reason)
      redis.call('ZREM', KEYS[5], id)
      redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'NODE_DEAD', node_id = id,
                                                   reason = reason, time_ms = now}))
      table.insert(dead, id)
    end
  end
end
for _, id in ipairs(dead) do
  buryNode(KEYS[3], KEYS[1], ARGV[1], ARGV[5], id, now, tonumber(ARGV[6]))
end
return dead
)lua";

// KEYS: meta hash. ARGV: '1' for the first beat of a gateway process (it has just started).
// The store gateway's own beat: when it was last heard from (store_gateway_beat_ms), and since
// when it has beaten without a gap over 1.5 s (store_gateway_since_ms), by the server's clock.
inline constexpr const char* kGatewayBeatScript = R"lua(
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local last = tonumber(redis.call('HGET', KEYS[1], 'store_gateway_beat_ms'))
if ARGV[1] == '1' or last == nil or now - last > 1500 then
  redis.call('HSET', KEYS[1], 'store_gateway_since_ms', now)
end
redis.call('HSET', KEYS[1], 'store_gateway_beat_ms', now)
return 1
)lua";

// KEYS: node hash, heartbeat key, nodes zset, dead-nodes zset, heartbeat-deadlines zset.
// ARGV: events channel, node id,
// reason, now ms, node hash prefix, claims prefix, DEAD nodes to keep.
// Returns -1 for an unknown node, 0 when it was already DEAD (nothing written or published).
inline constexpr const char* kMarkDeadBody = R"lua(
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'ALIVE' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'DEAD', 'death_reason', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[5], ARGV[2])
buryNode(KEYS[4], KEYS[3], ARGV[5], ARGV[6], ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[7]))
redis.call('PUBLISH', ARGV[1], cjson.encode({type = 'NODE_DEAD', node_id = ARGV[2],
                                             reason = ARGV[3], time_ms = tonumber(ARGV[4])}))
return 1
)lua";

// KEYS: an index zset (nodes, actors, pgs). ARGV: the prefix of its record hashes.
// One consistent snapshot in one round trip, in zset order (score, then id).
// ARGV[2]: a field left out of every record ('' for none).
inline constexpr const char* kListScript = R"lua(
local out = {}
local skip = ARGV[2]
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if skip ~= '' then
    for i = 1, #fields, 2 do
      if fields[i] == skip then
        table.remove(fields, i)
        table.remove(fields, i)
        break
      end
    end
  end
  if #fields > 0 then table.insert(out, fields) end
end
return out
)lua";

// KEYS: the actors zset, the actor-counts hash, the nodes zset. ARGV: key prefix, state ('' any),
// node id prefix ('' any), offset, limit, the prefix of the nodes' live-actor sets. Returns
// {state/count pairs of every actor, how many pass the filters, the page's records without
// init_args}. The counts come from the hash putActor keeps (made here by one pass over the
// records the first time, for a store written before it existed). Without filters only the
// page's records are read; with a state alone the walk stops once the page is full. A node filter
// with a state other than DEAD that names one node whole (no other node's id starts with it) reads
// that node's live-actor set, sorted as the list; any other node filter walks every record (its
// state and node only: at 100,000 actors a walk held Redis for over a second, and twenty in a row
// starved every heartbeat).
inline constexpr const char* kListActorsPageScript = R"lua(
local function strip(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'init_args' then
      table.remove(fields, i)
      table.remove(fields, i)
      break
    end
  end
  return fields
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  local counts = {}
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local state = redis.call('HGET', ARGV[1] .. id, 'state')
    if state then counts[state] = (counts[state] or 0) + 1 end
  end
  redis.call('HSET', KEYS[2], '_counted', '1')
  for state, n in pairs(counts) do redis.call('HSET', KEYS[2], state, n) end
end
local flat = {}
local stored = redis.call('HGETALL', KEYS[2])
for i = 1, #stored, 2 do
  if stored[i] ~= '_counted' and tonumber(stored[i + 1]) > 0 then
    table.insert(flat, stored[i])
    table.insert(flat, tonumber(stored[i + 1]))
  end
end
local first, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local page = {}
if ARGV[2] == '' and ARGV[3] == '' then
  if limit > 0 then
    for _, id in ipairs(redis.call('ZRANGE', KEYS[1], first, first + limit - 1)) do
      local fields = redis.call('HGETALL', ARGV[1] .. id)
      if #fields > 0 then table.insert(page, strip(fields)) end
    end
  end
  return {flat, redis.call('ZCARD', KEYS[1]), page}
end
if ARGV[3] ~= '' and ARGV[2] ~= '' and ARGV[2] ~= 'DEAD' then
  local named = 0
  for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    if string.sub(id, 1, #ARGV[3]) == ARGV[3] then named = named + (id == ARGV[3] and 1 or 2) end
  end
  if named == 1 then
    local members = {}
    for _, id in ipairs(redis.call('SMEMBERS', ARGV[6] .. ARGV[3])) do
      local score = redis.call('ZSCORE', KEYS[1], id)
      local f = redis.call('HMGET', ARGV[1] .. id, 'state', 'node_id')
      if score and f[1] == ARGV[2] and f[2] == ARGV[3] then table.insert(members, {tonumber(score), id}) end
    end
    table.sort(members, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
    local last = first + limit
    for i, m in ipairs(members) do
      if i - 1 >= first and i - 1 < last then table.insert(page, strip(redis.call('HGETALL', ARGV[1] .. m[2]))) end
    end
    return {flat, #members, page}
  end
end
local known = nil
if ARGV[3] == '' then known = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0') end
local last, matching, total, chunk = first + limit, 0, redis.call('ZCARD', KEYS[1]), 1000
for from = 0, total - 1, chunk do
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], from, from + chunk - 1)) do
    local key = ARGV[1] .. id
    local f = redis.call('HMGET', key, 'state', 'node_id')
    if f[1] and (ARGV[2] == '' or f[1] == ARGV[2]) and (ARGV[3] == '' or string.sub(f[2] or '', 1, #ARGV[3]) == ARGV[3]) then
      if matching >= first and matching < last then table.insert(page, strip(redis.call('HGETALL', key))) end
      matching = matching + 1
      if known and matching >= last then return {flat, known, page} end
    end
  end
end
return {flat, matching, page}
)lua";

// reserveClaims(keys, argv, k, a, n): claim i (1..n) has its node hash and that node's claims
// hash at keys[k + 2i - 1], keys[k + 2i], and its holder and resources (a JSON object) at
// argv[a + 2i - 1], argv[a + 2i]. All or nothing: checks every node first and returns false
// without writing when one refuses. A holder's new claim replaces its old one, so its old
// amount does not count against it. The caller guarantees each (node, holder) pair appears once.
inline constexpr const char* kReserveClaimsLua = R"lua(
local function reserveClaims(keys, argv, k, a, n)
  local eps = 1e-9
  local nodes, order = {}, {}
  for i = 1, n do
    local nodeKey = keys[k + 2 * i - 1]
    local node = nodes[nodeKey]
    if not node then
      node = {claimsKey = keys[k + 2 * i], holders = {}, demand = {}}
      nodes[nodeKey] = node
      table.insert(order, nodeKey)
    end
    node.holders[argv[a + 2 * i - 1]] = argv[a + 2 * i]
    for name, amount in pairs(cjson.decode(argv[a + 2 * i])) do
      node.demand[name] = (node.demand[name] or 0) + amount
    end
  end
  -- What the node's other claims use: its `used` less what these holders hold now (a
  -- repeated reservation replaces its own claim).
  for _, nodeKey in ipairs(order) do
    local node = nodes[nodeKey]
    if redis.call('HGET', nodeKey, 'state') ~= 'ALIVE' then return false end
    local total = cjson.decode(redis.call('HGET', nodeKey, 'total') or '{}')
    local others = cjson.decode(redis.call('HGET', nodeKey, 'used') or '{}')
    node.held = {}
    for holder, _ in pairs(node.holders) do
      local old = redis.call('HGET', node.claimsKey, holder)
      if old then
        for name, amount in pairs(cjson.decode(old)) do
          others[name] = (others[name] or 0) - amount
          node.held[name] = (node.held[name] or 0) + amount
        end
      end
    end
    for name, amount in pairs(node.demand) do
      if amount > 0 and (others[name] or 0) + amount > (total[name] or 0) + eps then return false end
    end
  end
  for _, nodeKey in ipairs(order) do
    local node = nodes[nodeKey]
    for holder, resources in pairs(node.holders) do
      redis.call('HSET', node.claimsKey, holder, resources)
    end
    addUsed(nodeKey, node.held, -1)
    addUsed(nodeKey, node.demand, 1)
  end
  return true
end
)lua";

// KEYS: per reservation, its node hash and claims hash. ARGV: per reservation, holder, resources.
inline constexpr const char* kReserveBody = R"lua(
if reserveClaims(KEYS, ARGV, 0, 0, #KEYS / 2) then return 1 end
return 0
)lua";

// KEYS: per claim, its node hash and claims hash. ARGV: per claim, holder, resources (JSON).
// Each claim on its own, in order (not all or nothing): returns per claim 1 (made) or 0 (its
// node is not ALIVE or lacks the room), as the reserve script of that claim alone would. A
// node's total and used are decoded once and `used` written once, however many of the batch's
// claims land on it (a controller places hundreds of actors per batch on a few nodes each).
inline constexpr const char* kReserveEachBody = R"lua(
local eps = 1e-9
local nodes, order, out = {}, {}, {}
for i = 1, #KEYS / 2 do
  local nodeKey, claimsKey = KEYS[2 * i - 1], KEYS[2 * i]
  local node = nodes[nodeKey]
  if not node then
    node = {alive = redis.call('HGET', nodeKey, 'state') == 'ALIVE', changed = {}}
    if node.alive then
      node.total = cjson.decode(redis.call('HGET', nodeKey, 'total') or '{}')
      node.used = cjson.decode(redis.call('HGET', nodeKey, 'used') or '{}')
    end
    nodes[nodeKey] = node
    table.insert(order, nodeKey)
  end
  out[i] = 0
  if node.alive then
    local holder, resources = ARGV[2 * i - 1], ARGV[2 * i]
    local demand = cjson.decode(resources)
    local old = redis.call('HGET', claimsKey, holder)
    local held = old and cjson.decode(old) or {}
    local room = true
    for name, amount in pairs(demand) do
      if amount > 0 and (node.used[name] or 0) - (held[name] or 0) + amount > (node.total[name] or 0) + eps then
        room = false
      end
    end
    if room then
      for name, amount in pairs(held) do
        node.used[name] = (node.used[name] or 0) - amount
        node.changed[name] = true
      end
      for name, amount in pairs(demand) do
        node.used[name] = (node.used[name] or 0) + amount
        node.changed[name] = true
      end
      redis.call('HSET', claimsKey, holder, resources)
      out[i] = 1
    end
  end
end
for _, nodeKey in ipairs(order) do
  local node = nodes[nodeKey]
  if next(node.changed) ~= nil then
    for name, _ in pairs(node.total) do node.used[name] = node.used[name] or 0 end
    for name, _ in pairs(node.changed) do
      if math.abs(node.used[name]) <= 1e-9 * math.max(1, node.total[name] or 0) then node.used[name] = 0 end
    end
    writeUsed(nodeKey, node.used)
  end
end
return out
)lua";

// KEYS: group hash, groups zset, pending-groups set, then per claim its node hash and claims
// hash. ARGV: claim count, created ms, id, state, per claim its holder and resources, then the
// hash's field/value pairs. Returns the existing record's fields for a group that exists
// (nothing written), 0 when a claim does not fit (nothing written), 1 when created.
inline constexpr const char* kCreateGroupBody = R"lua(
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HGETALL', KEYS[1]) end
local n = tonumber(ARGV[1])
if n > 0 and not reserveClaims(KEYS, ARGV, 3, 4, n) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5 + 2 * n))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] == 'PENDING' then redis.call('SADD', KEYS[3], ARGV[3]) end
return 1
)lua";

// KEYS: group hash, groups zset, pending-groups set, the group's live-actors set, waiting-actors
// set. ARGV: id, claims-hash prefix, node-hash prefix. Returns {outcome, waiting}: outcome 0 not
// found, 1 removed (record deleted, bundles' claims released), 2 it has live actors (nothing
// done); waiting: how many groups and actors wait for resources.
inline constexpr const char* kRemoveGroupBody = R"lua(
local waiting = function() return redis.call('SCARD', KEYS[3]) + redis.call('SCARD', KEYS[5]) end
local bundles = redis.call('HGET', KEYS[1], 'bundles')
if not bundles then return {0, waiting()} end
if redis.call('SCARD', KEYS[4]) > 0 then return {2, waiting()} end
for i, bundle in ipairs(cjson.decode(bundles)) do
  local node = bundle['node_id']
  if type(node) == 'string' and node ~= '' then
    local claims, holder = ARGV[2] .. node, 'pg:' .. ARGV[1] .. ':' .. (i - 1)
    local held = redis.call('HGET', claims, holder)
    if held then
      redis.call('HDEL', claims, holder)
      local nodeKey = ARGV[3] .. node
      if redis.call('EXISTS', nodeKey) == 1 then addUsed(nodeKey, cjson.decode(held), -1) end
    end
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return {1, waiting()}
)lua";

// KEYS: group hash, groups zset, pending-groups set. ARGV: created ms, id, state, then the
// hash's field/value pairs. Replaces the whole record and keeps the pending index true.
inline constexpr const char* kPutGroupScript = R"lua(
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
if ARGV[3] == 'PENDING' then redis.call('SADD', KEYS[3], ARGV[2]) else redis.call('SREM', KEYS[3], ARGV[2]) end
return 1
)lua";

// KEYS: sets of ids. ARGV: per set, the prefix of its members' record hashes. Per set, the
// records of its members, in no order (one set: that list alone); members whose record is gone
// are dropped from their set.
inline constexpr const char* kListSetScript = R"lua(
local lists = {}
for i, set in ipairs(KEYS) do
  local out = {}
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    local fields = redis.call('HGETALL', ARGV[i] .. id)
    if #fields > 0 then table.insert(out, fields) else redis.call('SREM', set, id) end
  end
  lists[i] = out
end
if #KEYS == 1 then return lists[1] end
return lists
)lua";

// KEYS: per claim, its node hash and that node's claims hash. ARGV: per claim, the holder.
// `used` is rewritten only on nodes that lost a claim, and only while the node exists.
inline constexpr const char* kReleaseBody = R"lua(
for i = 1, #ARGV do
  local nodeKey = KEYS[2 * i - 1]
  local held = redis.call('HGET', KEYS[2 * i], ARGV[i])
  if held then
    redis.call('HDEL', KEYS[2 * i], ARGV[i])
    if redis.call('EXISTS', nodeKey) == 1 then addUsed(nodeKey, cjson.decode(held), -1) end
  end
end
return 1
)lua";

// KEYS: group hash, groups zset, pending-groups set. ARGV: the group's id. All go together.
inline constexpr const char* kDeleteGroupScript = R"lua(
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
)lua";

// KEYS: actor hash, actors zset, live-actors zset, dead-actors zset, waiting-actors set, the
// live-actors set of its placement group ('' when none), the actor-counts hash (by state, of the
// records in the actors zset; kept once kListActorsPageScript has made it).
// ARGV: created ms, id, state, keep, updated ms, actor hash prefix, waiting ('1' when it waits
// for a node), the prefix of the groups' live-actors sets, the prefix of the nodes' live-actors
// sets, its node id ('' when none), then the hash's field/value pairs. Live actors are indexed
// on their own, and by node, so the controller's scans cost what is alive (or what was on a
// node that died), not the history; only the newest `keep` DEAD actors are kept (for status),
// older ones deleted.
inline constexpr const char* kPutActorScript = R"lua(
local was = redis.call('HMGET', KEYS[1], 'placement_group', 'node_id', 'state')
if was[1] and was[1] ~= '' then redis.call('SREM', ARGV[8] .. was[1], ARGV[2]) end
if was[2] and was[2] ~= '' then redis.call('SREM', ARGV[9] .. was[2], ARGV[2]) end
local counted = redis.call('EXISTS', KEYS[7]) == 1
if counted then
  if was[3] then redis.call('HINCRBY', KEYS[7], was[3], -1) end
  redis.call('HINCRBY', KEYS[7], ARGV[3], 1)
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 11))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
if ARGV[7] == '1' then redis.call('SADD', KEYS[5], ARGV[2]) else redis.call('SREM', KEYS[5], ARGV[2]) end
if ARGV[3] ~= 'DEAD' then
  redis.call('ZADD', KEYS[3], ARGV[1], ARGV[2])
  if KEYS[6] ~= '' then redis.call('SADD', KEYS[6], ARGV[2]) end
  if ARGV[10] ~= '' then redis.call('SADD', ARGV[9] .. ARGV[10], ARGV[2]) end
  return 1
end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[2])
local extra = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[4])
if extra > 0 then
  local gone = 0
  for _, old in ipairs(redis.call('ZRANGE', KEYS[4], 0, extra - 1)) do
    gone = gone + redis.call('DEL', ARGV[6] .. old)
    redis.call('ZREM', KEYS[2], old)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, extra - 1)
  if counted then redis.call('HINCRBY', KEYS[7], 'DEAD', -gone) end
end
return 1
)lua";

// KEYS: the dead-nodes zset. ARGV: the claims-hash prefix, the nodes' live-actors set prefix.
// The DEAD nodes that still hold a claim or a live actor, oldest death first.
inline constexpr const char* kDeadNodesWithWorkScript = R"lua(
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 1 or redis.call('SCARD', ARGV[2] .. id) > 0 then
    table.insert(out, id)
  end
end
return out
)lua";

// KEYS: name key. ARGV: actor id. 1 when the name was free or already this actor's, so a
// retried claim whose first reply was lost still reports success.
inline constexpr const char* kClaimNameScript = R"lua(
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
if holder == ARGV[1] then return 1 end
return 0
)lua";

// KEYS: name key. ARGV: actor id. Deletes the name only if this actor holds it.
inline constexpr const char* kReleaseNameScript = R"lua(
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
)lua";

// KEYS: the group's epoch key. ARGV: the wanted epoch, the group's epoch channel.
// Raises the epoch (never lowers it) and publishes only a real change, so a retry is silent.
// Returns the epoch after the call as text (Lua numbers are doubles; the text stays exact).
inline constexpr const char* kAdvanceGroupEpochScript = R"lua(
local current = redis.call('GET', KEYS[1]) or '0'
if tonumber(ARGV[1]) > tonumber(current) then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return ARGV[1]
end
return current
)lua";

// KEYS: the group's document, the groups zset. ARGV: id, doc, now ms.
inline constexpr const char* kPutElasticGroupScript = R"lua(
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[1])
return 1
)lua";

// KEYS: the group's document, its events list. ARGV: text, how many to keep. A line equal to
// one of the newest 32 is a retry: it is not added twice.
inline constexpr const char* kAppendGroupEventScript = R"lua(
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for _, line in ipairs(redis.call('LRANGE', KEYS[2], -32, -1)) do
  if line == ARGV[1] then return 1 end
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[2]), -1)
return 1
)lua";

// KEYS: the group's document, its commands list. ARGV: the command as a JSON object without its
// seq (store_records::groupCommandJson), its nonce ('' for none), how many to keep. Returns
// {1, seq} (the seq as text), or {0, ''} for an unknown group. The seq is one more than the
// newest kept command's; a command whose nonce is one kept already is a retry: its seq is
// returned and nothing appended. The seq is prepended as text ('%d'), so no number of the
// caller's passes through Lua's doubles.
inline constexpr const char* kAppendGroupCommandScript = R"lua(
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, ''} end
local newest = 0
for _, line in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  local command = cjson.decode(line)
  if ARGV[2] ~= '' and command.nonce == ARGV[2] then return {1, string.format('%d', command.seq)} end
  newest = command.seq
end
local seq = string.format('%d', newest + 1)
redis.call('RPUSH', KEYS[2], '{"seq":' .. seq .. ',' .. string.sub(ARGV[1], 2))
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
return {1, seq}
)lua";

// KEYS: document, events, groups zset, epoch, commands. ARGV: id, the rendezvous key prefix, the key
// space prefixes (values, adds done) of its epochs (the rendezvous and the key space of each
// epoch up to the current one are deleted; they expire anyway).
inline constexpr const char* kDeleteElasticGroupScript = R"lua(
local epoch = tonumber(redis.call('GET', KEYS[4]) or '0')
for e = 0, epoch do redis.call('DEL', ARGV[2] .. e, ARGV[3] .. e, ARGV[4] .. e) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
)lua";

// KEYS: the rendezvous hash. ARGV: rank, value, ttl ms. The write and the expiry go together.
inline constexpr const char* kPutRendezvousScript = R"lua(
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
)lua";

// Key spaces. KEYS[1]: the space's hash (key -> value). ARGV: key, value, ttl ms.
inline constexpr const char* kSetKeyScript = R"lua(
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
)lua";

// KEYS: the space's hash, its adds done (add id -> the sum it returned). ARGV: key, delta, ttl
// ms, the add's id ("" for a delta of 0, which changes nothing when the key exists). A retried
// add returns its first sum instead of adding again. Returns {1, sum} or {0, the value} when the
// value is not a decimal integer; the sum is read back as text (a Lua number holds 53 bits).
inline constexpr const char* kAddToKeyScript = R"lua(
if ARGV[4] ~= '' then
  local done = redis.call('HGET', KEYS[2], ARGV[4])
  if done then return {1, done} end
end
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value and (not string.match(value, '^%-?%d+$') or string.len(value) > 20) then return {0, value} end
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local sum = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[4], sum)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return {1, sum}
)lua";

// KEYS: the space's hash. ARGV: key, expected, desired, ttl ms. Repeating it after it set the
// key returns the same value (the key now holds `desired`).
inline constexpr const char* kCompareSetKeyScript = R"lua(
local value = redis.call('HGET', KEYS[1], ARGV[1])
if (not value and ARGV[2] == '') or value == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return ARGV[3]
end
if not value then return ARGV[2] end
return value
)lua";

// KEYS: the space's hash. Its size. HGETALL rather than HLEN: the store gateway relays HGETALL
// (store_gateway.cc's list) and a space holds a few keys.
inline constexpr const char* kCountKeysScript = R"lua(
return #redis.call('HGETALL', KEYS[1]) / 2
)lua";

inline const std::string& registerScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kStoreUpLua + kRegisterBody;
  return script;
}
inline const std::string& heartbeatScript() {
  static const std::string script = kHeartbeatBody;
  return script;
}
inline const std::string& reapScript() {
  static const std::string script = std::string(kStoreUpLua) + kBuryNodeLua + kReapBody;
  return script;
}
inline const std::string& markDeadScript() {
  static const std::string script = std::string(kBuryNodeLua) + kMarkDeadBody;
  return script;
}
inline const std::string& reserveScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReserveClaimsLua + kReserveBody;
  return script;
}
inline const std::string& reserveEachScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReserveEachBody;
  return script;
}
inline const std::string& createGroupScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReserveClaimsLua + kCreateGroupBody;
  return script;
}
inline const std::string& removeGroupScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kRemoveGroupBody;
  return script;
}
inline const std::string& releaseScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReleaseBody;
  return script;
}

}  // namespace troupe::redis_scripts
