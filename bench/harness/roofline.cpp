// The machine's ceilings for bench/harness/roofline.py: read bandwidth and the peak rate of the integer
// dot-product instructions the native step's linears use. Prints one JSON object.
//
//     roofline [MiB]    // MiB: size of the array the bandwidth runs sum (default 1024)
//
// Bandwidth: one thread summing a large int32 array (what one stream's decode step does with the
// weights: read each byte once), then all OpenMP threads summing their own slices; best of 5 passes.
// Peaks: a loop of independent vpdpbusd (u8 x s8, 64 multiply-adds an instruction) or vpdpwssd
// (s16 x s16, 32) on 512-bit registers, 12 accumulators so that the instruction's throughput, not its
// latency, bounds it; AMX tdpbusd (16x64 by 64x16 int8 tiles, 16,384 multiply-adds) where the CPU and the
// kernel allow it. An "op" is a multiply or an add, so a multiply-add counts 2. Each instruction set is
// checked at run time; one the CPU lacks reports null.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static uint32_t sum_slice(const int32_t* data, int64_t n) {
    uint32_t total = 0;  // wraps: the value only keeps the loop from being optimized away
    for (int64_t i = 0; i < n; ++i) total += data[i];
    return total;
}

// Best bytes/s over `passes` sums of the array by `threads` threads (each its own contiguous slice).
static double read_bandwidth(const int32_t* data, int64_t n, int threads, int passes, int64_t* sink) {
    double best = 0;
    for (int pass = 0; pass < passes; ++pass) {
        int64_t total = 0;
        double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            int t = omp_get_thread_num(), count = omp_get_num_threads();
            int64_t begin = n * t / count, end = n * (t + 1) / count;
            total += sum_slice(data + begin, end - begin);
        }
        double seconds = now() - start;
        *sink += total;
        if (seconds > 0 && n * 4.0 / seconds > best) best = n * 4.0 / seconds;
    }
    return best;
}

constexpr int ACCUMULATORS = 12;

__attribute__((target("avx512f,avx512vnni"))) static int64_t vnni_loop(int64_t iterations, bool words) {
    __m512i acc[ACCUMULATORS];
    for (int i = 0; i < ACCUMULATORS; ++i) acc[i] = _mm512_set1_epi32(i);
    const __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x01010101);
    for (int64_t it = 0; it < iterations; ++it) {
        for (int i = 0; i < ACCUMULATORS; ++i)
            acc[i] = words ? _mm512_dpwssd_epi32(acc[i], a, b) : _mm512_dpbusd_epi32(acc[i], a, b);
    }
    __m512i total = acc[0];
    for (int i = 1; i < ACCUMULATORS; ++i) total = _mm512_add_epi32(total, acc[i]);
    return _mm512_reduce_add_epi32(total);
}

// Multiply-add ops/s (2 per multiply-add) of the VNNI instruction over `threads` threads, best of 3.
static double vnni_peak(int threads, bool words, int64_t* sink) {
    const int64_t iterations = 20'000'000;
    const double macs = double(iterations) * ACCUMULATORS * (words ? 32 : 64);
    double best = 0;
    for (int pass = 0; pass < 3; ++pass) {
        int64_t total = 0;
        double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        total += vnni_loop(iterations, words);
        double seconds = now() - start;
        *sink += total;
        if (seconds > 0 && 2 * macs * threads / seconds > best) best = 2 * macs * threads / seconds;
    }
    return best;
}

#ifdef __AMX_INT8__
struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

static bool amx_permitted() {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

__attribute__((target("amx-tile,amx-int8"))) static int64_t amx_loop(int64_t iterations) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
    alignas(64) static thread_local int8_t a[16 * 64], b[16 * 64];
    alignas(64) static thread_local int32_t c[16 * 16];
    memset(a, 1, sizeof a), memset(b, 1, sizeof b), memset(c, 0, sizeof c);
    _tile_loadd(0, c, 64);  // the tile macros are statements: one a line
    _tile_loadd(1, c, 64);
    _tile_loadd(2, c, 64);
    _tile_loadd(3, c, 64);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b, 64);
    for (int64_t it = 0; it < iterations; ++it) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0];
}

static double amx_peak(int threads, int64_t* sink) {
    const int64_t iterations = 2'000'000;
    const double macs = double(iterations) * 4 * 16 * 16 * 64;
    double best = 0;
    for (int pass = 0; pass < 3; ++pass) {
        int64_t total = 0;
        double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        total += amx_loop(iterations);
        double seconds = now() - start;
        *sink += total;
        if (seconds > 0 && 2 * macs * threads / seconds > best) best = 2 * macs * threads / seconds;
    }
    return best;
}
#endif

static void print_number(const char* key, double value, bool present, bool last = false) {
    if (present)
        printf("\"%s\": %.6g%s", key, value, last ? "" : ", ");
    else
        printf("\"%s\": null%s", key, last ? "" : ", ");
}

int main(int argc, char** argv) {
    const int64_t mib = argc > 1 ? atoll(argv[1]) : 1024;
    const int64_t n = mib * 1024 * 1024 / 4;
    const int threads = omp_get_max_threads();
    std::vector<int32_t> data(n);
    for (int64_t i = 0; i < n; ++i) data[i] = int32_t(i & 0xff);  // touched: every page is resident
    int64_t sink = 0;
    const double one = read_bandwidth(data.data(), n, 1, 5, &sink);
    const double all = read_bandwidth(data.data(), n, threads, 5, &sink);
    __builtin_cpu_init();
    const bool vnni = __builtin_cpu_supports("avx512vnni");
    bool amx = false;
    double amx_one = 0, amx_all = 0;
#ifdef __AMX_INT8__
    if (__builtin_cpu_supports("amx-int8") && amx_permitted()) {
        amx = true;
        amx_one = amx_peak(1, &sink), amx_all = amx_peak(threads, &sink);
    }
#endif
    printf("{\"threads\": %d, \"array_bytes\": %lld, ", threads, (long long)(n * 4));
    print_number("read_bytes_s_1_thread", one, true);
    print_number("read_bytes_s_all_threads", all, true);
    print_number("vpdpbusd_ops_s_1_thread", vnni ? vnni_peak(1, false, &sink) : 0, vnni);
    print_number("vpdpbusd_ops_s_all_threads", vnni ? vnni_peak(threads, false, &sink) : 0, vnni);
    print_number("vpdpwssd_ops_s_1_thread", vnni ? vnni_peak(1, true, &sink) : 0, vnni);
    print_number("vpdpwssd_ops_s_all_threads", vnni ? vnni_peak(threads, true, &sink) : 0, vnni);
    print_number("amx_tdpbusd_ops_s_1_thread", amx_one, amx);
    print_number("amx_tdpbusd_ops_s_all_threads", amx_all, amx);
    printf("\"sink\": %lld}\n", (long long)(sink & 1));
    return 0;
}
