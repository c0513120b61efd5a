"""What runs in a worker process or a Ray actor: the child's main, its envs, the stepping loop,
policies, the weight store and the server-inference client. It imports only :mod:`aiocollect._core`."""
