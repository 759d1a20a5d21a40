"""An echo server in a process of its own, for tests that need more
connections than the test process may hold open (its open-file limit).

Prints the port it listens on (127.0.0.1, ephemeral), then echoes every
byte of every connection until the client closes. Standard library only.
"""

import asyncio


async def echo(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main():
    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


asyncio.run(main())
