// Launch-bound microbenchmark: the cost of one empty kernel launch and of one allocation,
// measured through the CUDA runtime (which reaches the driver through cuGetProcAddress, the
// path nvshare intercepts). Prints one JSON line.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

__global__ void empty_kernel() {}

static void check(cudaError_t status, const char *what) {
    if (status != cudaSuccess) {
        std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
        std::exit(1);
    }
}

static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

static double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
}

int main(int argc, char **argv) {
    int launches = argc > 1 ? std::atoi(argv[1]) : 200000;
    int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
    check(cudaFree(0), "init");
    for (int i = 0; i < 20000; i++) empty_kernel<<<1, 1>>>();  // warm-up
    check(cudaDeviceSynchronize(), "warm-up");

    std::vector<double> per_launch;
    for (int r = 0; r < rounds; r++) {
        auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < launches; i++) empty_kernel<<<1, 1>>>();
        check(cudaDeviceSynchronize(), "launch loop");
        per_launch.push_back(seconds_since(start) / launches * 1e9);
    }

    // Allocation latency: median of alloc+free pairs, memory untouched (the safety rule holds).
    const size_t sizes[] = {1u << 20, 256u << 20};
    double alloc_ns[2], free_ns[2];
    for (int s = 0; s < 2; s++) {
        std::vector<double> a, f;
        for (int i = 0; i < 50; i++) {
            void *p = nullptr;
            auto start = std::chrono::steady_clock::now();
            check(cudaMalloc(&p, sizes[s]), "cudaMalloc");
            a.push_back(seconds_since(start) * 1e9);
            start = std::chrono::steady_clock::now();
            check(cudaFree(p), "cudaFree");
            f.push_back(seconds_since(start) * 1e9);
        }
        alloc_ns[s] = median(a);
        free_ns[s] = median(f);
    }
    std::printf("{\"launch_ns_median\": %.1f, \"launch_ns_min\": %.1f, \"launches\": %d, \"rounds\": %d, "
                "\"alloc_1MiB_ns\": %.0f, \"free_1MiB_ns\": %.0f, \"alloc_256MiB_ns\": %.0f, \"free_256MiB_ns\": %.0f}\n",
                median(per_launch), *std::min_element(per_launch.begin(), per_launch.end()), launches, rounds,
                alloc_ns[0], free_ns[0], alloc_ns[1], free_ns[1]);
    return 0;
}
