-- wrk script: benches/load/post.lua (the JSON body of the file $KVB_BODY, one summary line at
-- the end), each request with the API key $KVB_KEY_PREFIX<i>, i drawn at random from
-- 0 .. $KVB_KEYS - 1 (with $KVB_IN_TURN set: 0, 1, 2, ... in turn, from 0 again after the last).
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "../load/post.lua")

local keys = tonumber(os.getenv("KVB_KEYS"))
local prefix = os.getenv("KVB_KEY_PREFIX")
local in_turn = os.getenv("KVB_IN_TURN")
local next_key = 0

init = function(args)
  math.randomseed(os.time())
end

request = function()
  local i
  if in_turn then
    i = next_key
    next_key = (next_key + 1) % keys
  else
    i = math.random(0, keys - 1)
  end
  wrk.headers["Authorization"] = "Bearer " .. prefix .. i
  return wrk.format()
end
