// The glue around cuBLAS's bf16 GEMMs: activations rounded to bf16 for the GEMM's input,
// and a bias added to its f32 output. Twins: `half::bf16::from_f32` (round to nearest
// even) and the bias loop of the model's `Linear`.

// out[i] = bf16(x[i]) for n values.
extern "C" __global__ void round_bf16(bf16_t* out, const float* x, unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(x[i]);
    }
}

// y[t, j] += bias[j] for every row t of `cols` values (n values in all).
extern "C" __global__ void add_bias_f32(
    float* y, const float* bias, unsigned int cols, unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x) {
        y[i] += bias[i % cols];
    }
}
