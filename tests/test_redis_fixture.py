async def test_real_redis_answers(redis_client):
    await redis_client.set("k", "v")
    assert await redis_client.get("k") == b"v"
    info = await redis_client.info("server")
    assert info["redis_version"] >= "6.2"
