-- wrk script: benches/load/post.lua (the JSON body of the file $KVB_BODY, one summary line at
-- the end), each request with the API key $KVB_KEY_PREFIX<i>, i drawn at random from
-- 0 .. $KVB_KEYS - 1.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "../load/post.lua")

local keys = tonumber(os.getenv("KVB_KEYS"))
local prefix = os.getenv("KVB_KEY_PREFIX")

init = function(args)
  math.randomseed(os.time())
end

request = function()
  wrk.headers["Authorization"] = "Bearer " .. prefix .. math.random(0, keys - 1)
  return wrk.format()
end
