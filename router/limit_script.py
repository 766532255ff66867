"""The one Lua script of router.limits and the Redis keys it works on (D24).

Every limited key's state lives under its own hash tag (``mirbad:rl:{<key id>}:...``),
so the script also runs on a Redis Cluster. router/limits.py says what the script is
for; this module is what runs in Redis.
"""

from __future__ import annotations

__all__ = ["FULL_RPM", "FULL_SLOTS", "SYNC", "leases_key", "rpm_key", "slots_key", "tpm_key"]

FULL_RPM, FULL_SLOTS = 1, 3  # the script's refusal codes (2: TPM, seen in the count)

# KEYS: rpm window, tpm window, previous tpm window, lease deadlines (zset),
#       lease slot counts (hash).
# ARGV: 1 rpm limit, 2 permits wanted (< 0: given back), 3 tpm limit,
#       4 tokens for this window, 5 tokens for the previous one, 6 concurrency limit,
#       7 slots this lease should hold (-1: leave the lease alone), 8 now,
#       9 lease deadline, 10 lease id, 11 window ttl, 12 lease ttl,
#       13 '1' when requests wait on the answer (refusals and growth apply).
# Returns {code, permits granted, rpm count, tpm count, lease slots before,
#          lease slots after, slots of all leases}; code 0 ok, 1 rpm, 2 tpm,
#          3 concurrency (nothing granted).
SYNC = """
local rpm_limit = tonumber(ARGV[1])
local want = tonumber(ARGV[2])
local tpm_limit = tonumber(ARGV[3])
local conc_limit = tonumber(ARGV[6])
local target = tonumber(ARGV[7])
local need = ARGV[13] == '1'
local tpm = 0
local add = tonumber(ARGV[4])
if add > 0 then
  tpm = redis.call('INCRBY', KEYS[2], add)
  redis.call('EXPIRE', KEYS[2], ARGV[11])
elseif tpm_limit > 0 then
  tpm = tonumber(redis.call('GET', KEYS[2]) or '0')
end
local late = tonumber(ARGV[5])
if late > 0 then
  redis.call('INCRBY', KEYS[3], late)
  redis.call('EXPIRE', KEYS[3], ARGV[11])
end
local rpm = 0
if rpm_limit > 0 or want < 0 then rpm = tonumber(redis.call('GET', KEYS[1]) or '0') end
local before, mine, held = 0, 0, 0
if target >= 0 then
  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[8])
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[8])
    redis.call('HDEL', KEYS[5], unpack(dead))
  end
  before = tonumber(redis.call('HGET', KEYS[5], ARGV[10]) or '0')
  for _, n in ipairs(redis.call('HVALS', KEYS[5])) do held = held + tonumber(n) end
  mine = before
end
local code = 0
if need then
  if want > 0 and rpm >= rpm_limit then code = 1
  elseif tpm_limit > 0 and tpm >= tpm_limit then code = 2
  elseif target > before and held >= conc_limit then code = 3 end
end
local granted = 0
if want > 0 and code == 0 then
  granted = math.max(0, math.min(want, rpm_limit - rpm))
  if granted > 0 then
    rpm = redis.call('INCRBY', KEYS[1], granted)
    if rpm == granted then redis.call('EXPIRE', KEYS[1], ARGV[11]) end
  end
elseif want < 0 and rpm > 0 then
  rpm = redis.call('DECRBY', KEYS[1], math.min(-want, rpm))
end
if target >= 0 then
  if target <= before then
    mine = target
  elseif need and code == 0 then
    mine = math.min(target, before + math.max(0, conc_limit - held))
  end
  if mine > 0 then
    redis.call('HSET', KEYS[5], ARGV[10], mine)
    redis.call('ZADD', KEYS[4], ARGV[9], ARGV[10])
    redis.call('EXPIRE', KEYS[4], ARGV[12])
    redis.call('EXPIRE', KEYS[5], ARGV[12])
  elseif before > 0 then
    redis.call('HDEL', KEYS[5], ARGV[10])
    redis.call('ZREM', KEYS[4], ARGV[10])
  end
  held = held - before + mine
end
return {code, granted, rpm, tpm, before, mine, held}
"""


def rpm_key(key_id: int, minute: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:rpm:{minute}"


def tpm_key(key_id: int, minute: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:tpm:{minute}"


def leases_key(key_id: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:leases"


def slots_key(key_id: int) -> str:
    return f"mirbad:rl:{{{key_id}}}:slots"
