"""The Lua of router.queue: slots per replica and one fair queue per served name.

router/queue.py says what the queue is for; this module is what runs in Redis.
Every key of one served name lives under its own hash tag
(``mirbad:q:{<served name>}:...``); the scripts build the per-priority and per-key
list names inside that tag, so one name's queue stays in one Cluster slot.

Keys under the tag (``base`` below):

- ``busy``     hash   instance id -> slots in use, all processes together
- ``tickets``  hash   ticket -> instance id, one per slot in use
- ``waiters``  hash   ticket -> "<priority>\\t<key id>", one per queued request
- ``prio``     zset   priorities with waiters, scored -priority (highest first)
- ``ring:<p>`` list   key ids of priority p with waiters, in round-robin order
- ``wait:<p>:<key>`` list  that key's queued tickets, in arrival order
- ``procs``    zset   process id -> lease deadline (Unix seconds)
- ``last``     string Unix time of the latest request for the name
- ``wait``     string ms the latest answered request waited in line

A ticket is ``<process id>:<counter>``, so the sweep can tell whose it is. A process
whose lease lapsed (it died) loses its slots and its waiters at the next script run
of any process.

Every script takes ARGV: 1 base, 2 now, 3 process id, 4 lease seconds, 5 n, then n
pairs (instance id, capacity) of the replicas that take traffic, in the caller's
preferred order (it shuffles them: ties go to the first). What follows depends on
the script.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "LEAVE", "POLL", "RELEASE", "RENEW"]

_COMMON = r"""
local base = ARGV[1]
local now = tonumber(ARGV[2])
local me = ARGV[3]
local n = tonumber(ARGV[5])
local caps = {}
for i = 1, n do caps[i] = {ARGV[4 + 2 * i], tonumber(ARGV[5 + 2 * i])} end
local rest = 6 + 2 * n

redis.call('ZADD', base .. 'procs', now + tonumber(ARGV[4]), me)
redis.call('EXPIRE', base .. 'procs', 3600)

local function owner(ticket) return string.match(ticket, '^([^:]+):') end

local function unqueue(ticket, info)
  local tab = string.find(info, '\t', 1, true)
  local prio = string.sub(info, 1, tab - 1)
  local key = string.sub(info, tab + 1)
  local list = base .. 'wait:' .. prio .. ':' .. key
  redis.call('LREM', list, 0, ticket)
  if redis.call('LLEN', list) == 0 then
    local ring = base .. 'ring:' .. prio
    redis.call('LREM', ring, 0, key)
    if redis.call('LLEN', ring) == 0 then redis.call('ZREM', base .. 'prio', prio) end
  end
  redis.call('HDEL', base .. 'waiters', ticket)
end

local function free_slot(ticket)
  local inst = redis.call('HGET', base .. 'tickets', ticket)
  if not inst then return false end
  redis.call('HDEL', base .. 'tickets', ticket)
  if redis.call('HINCRBY', base .. 'busy', inst, -1) <= 0 then
    redis.call('HDEL', base .. 'busy', inst)
  end
  return inst
end

-- A process that stopped renewing its lease died: its slots and waiters go.
local dead = redis.call('ZRANGEBYSCORE', base .. 'procs', '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', base .. 'procs', '-inf', now)
  local gone = {}
  for _, p in ipairs(dead) do gone[p] = true end
  local held = redis.call('HGETALL', base .. 'tickets')
  for i = 1, #held, 2 do
    if gone[owner(held[i])] then free_slot(held[i]) end
  end
  local queued = redis.call('HGETALL', base .. 'waiters')
  for i = 1, #queued, 2 do
    if gone[owner(queued[i])] then unqueue(queued[i], queued[i + 1]) end
  end
end

-- The replica with a free slot and the fewest in use; ties to the first listed.
local function pick()
  local best, fewest = false, nil
  for i = 1, n do
    local used = tonumber(redis.call('HGET', base .. 'busy', caps[i][1]) or '0')
    if used < caps[i][2] and (fewest == nil or used < fewest) then
      best, fewest = caps[i][1], used
    end
  end
  return best
end

local function grant(ticket, inst)
  redis.call('HINCRBY', base .. 'busy', inst, 1)
  redis.call('HSET', base .. 'tickets', ticket, inst)
  redis.call('EXPIRE', base .. 'busy', 86400)
  redis.call('EXPIRE', base .. 'tickets', 86400)
end

-- The head of the queue: highest priority, then the next key in that priority's
-- ring (which then goes to the back), then that key's oldest request.
local function pop_head()
  local top = redis.call('ZRANGE', base .. 'prio', 0, 0)
  if #top == 0 then return false end
  local prio = top[1]
  local ring = base .. 'ring:' .. prio
  local key = redis.call('LPOP', ring)
  if not key then
    redis.call('ZREM', base .. 'prio', prio)
    return false
  end
  local list = base .. 'wait:' .. prio .. ':' .. key
  local ticket = redis.call('LPOP', list)
  if redis.call('LLEN', list) > 0 then
    redis.call('RPUSH', ring, key)
  elseif redis.call('LLEN', ring) == 0 then
    redis.call('ZREM', base .. 'prio', prio)
  end
  if ticket then redis.call('HDEL', base .. 'waiters', ticket) end
  return ticket
end

-- Free slots go to the head of the queue, one by one; each grantee's process is
-- told on its channel (it also polls, so a lost message only delays it).
local granted = {}
local function pump(quiet, tell_own)
  while redis.call('HLEN', base .. 'waiters') > 0 do
    local inst = pick()
    if not inst then return end
    local ticket = pop_head()
    if not ticket then return end
    grant(ticket, inst)
    if ticket ~= quiet then
      local note = ticket .. '\t' .. inst
      table.insert(granted, note)
      -- RELEASE wakes the caller's own waiters from its answer: no round trip.
      if tell_own or owner(ticket) ~= me then
        redis.call('PUBLISH', 'mirbad:q:grant:' .. owner(ticket), note)
      end
    end
  end
end
"""

# ARGV after the capacities: ticket, priority, key id, queue bound.
# Returns {'ok', instance} | {'queued', depth} | {'full', depth}.
ACQUIRE = (
    _COMMON
    + r"""
local ticket, prio, key = ARGV[rest], ARGV[rest + 1], ARGV[rest + 2]
local bound = tonumber(ARGV[rest + 3])
redis.call('SET', base .. 'last', ARGV[2], 'EX', 30 * 86400)
local depth = redis.call('HLEN', base .. 'waiters')
if depth == 0 then
  local inst = pick()
  if inst then
    grant(ticket, inst)
    return {'ok', inst}
  end
end
if depth >= bound then return {'full', tostring(depth)} end
redis.call('HSET', base .. 'waiters', ticket, prio .. '\t' .. key)
local list = base .. 'wait:' .. prio .. ':' .. key
if redis.call('RPUSH', list, ticket) == 1 then
  redis.call('RPUSH', base .. 'ring:' .. prio, key)
end
redis.call('ZADD', base .. 'prio', -tonumber(prio), prio)
pump(ticket, true)
local inst = redis.call('HGET', base .. 'tickets', ticket)
if inst then return {'ok', inst} end
return {'queued', tostring(depth + 1)}
"""
)

# ARGV after the capacities: ticket. Hands free slots on (a replica that became
# ready, a lost message), then says where the ticket stands.
# Returns {'ok', instance} | {'queued', depth} | {'lost', ''}.
POLL = (
    _COMMON
    + r"""
local ticket = ARGV[rest]
pump(ticket, true)
local inst = redis.call('HGET', base .. 'tickets', ticket)
if inst then return {'ok', inst} end
if redis.call('HEXISTS', base .. 'waiters', ticket) == 1 then
  return {'queued', tostring(redis.call('HLEN', base .. 'waiters'))}
end
return {'lost', ''}
"""
)

# ARGV after the capacities: ticket, the ms it waited in line. Frees its slot and
# hands slots on; the wait is kept for the console (``wait``). Returns the grants
# made ("ticket\tinstance"); the caller wakes those of its own process.
RELEASE = (
    _COMMON
    + r"""
free_slot(ARGV[rest])
redis.call('SET', base .. 'wait', ARGV[rest + 1], 'EX', 3600)
pump(false, false)
return granted
"""
)

# ARGV after the capacities: ticket. A waiter gives up (timeout, client gone).
# Returns 'left' when it was still queued, 'released' when a slot had been granted
# meanwhile (it is freed and handed on), 'gone' when neither.
LEAVE = (
    _COMMON
    + r"""
local ticket = ARGV[rest]
local info = redis.call('HGET', base .. 'waiters', ticket)
if info then
  unqueue(ticket, info)
  return 'left'
end
if free_slot(ticket) then
  pump(false, true)
  return 'released'
end
return 'gone'
"""
)

# No ARGV after the capacities (n = 0): renews this process's lease on the name.
RENEW = (
    _COMMON
    + r"""
return 1
"""
)
