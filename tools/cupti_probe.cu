// What CUPTI's activity API does on a machine with an NVIDIA GPU: which clock its timestamps are on, how
// callbacks and records correlate (runtime + driver launches, CUDA graphs), what it costs per launch.
// Not part of the build; run by tools/device_check.sh on a GPU machine:
//   nvcc -O2 -arch=sm_90 -I<cupti include> -o probe tools/cupti_probe.cu -L<cupti lib> -lcupti -lcuda
//   ./probe mono   # timestamps through cuptiActivityRegisterTimestampCallback(CLOCK_MONOTONIC)
//   ./probe        # CUPTI's default timestamps
#include <cuda.h>
#include <cuda_runtime.h>
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#include <pthread.h>
#include <unistd.h>

static uint64_t clk(clockid_t c){ struct timespec ts; clock_gettime(c,&ts); return (uint64_t)ts.tv_sec*1000000000ull+ts.tv_nsec; }
static uint64_t mono(){ return clk(CLOCK_MONOTONIC); }
static uint64_t CUPTIAPI ts_cb(void){ return mono(); }
#define CK(x) do{ CUptiResult r_=(x); if(r_!=CUPTI_SUCCESS){ const char*s; cuptiGetResultString(r_,&s); printf("CUPTI FAIL %s -> %d %s\n", #x, r_, s); } }while(0)
#define CC(x) do{ cudaError_t e_=(x); if(e_!=cudaSuccess){ printf("CUDA FAIL %s -> %s\n", #x, cudaGetErrorString(e_)); exit(1);} }while(0)

__global__ void stamp(unsigned long long* dst){ unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); *dst = t; }
__global__ void spin(unsigned long long ns){ unsigned long long a,b; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(a)); do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(b)); } while (b - a < ns); }
__global__ void empty(){}

typedef struct { int kind; uint32_t corr; uint64_t start, end, graphNode; uint32_t graphId, stream; char name[48]; } Rec;
static Rec recs[200000]; static int nrec; static size_t dropped; static int buffers;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void CUPTIAPI req(uint8_t **b, size_t *s, size_t *m){ *s = 4<<20; *b = (uint8_t*)aligned_alloc(8, *s); *m = 0; }
static void CUPTIAPI done(CUcontext ctx, uint32_t sid, uint8_t *b, size_t s, size_t valid){
  CUpti_Activity *r = NULL; pthread_mutex_lock(&mu); buffers++;
  while (cuptiActivityGetNextRecord(b, valid, &r) == CUPTI_SUCCESS) {
    if (nrec >= 200000) break;
    Rec *o = &recs[nrec];
    memset(o, 0, sizeof *o);
    o->kind = r->kind;
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10*)r; o->corr=k->correlationId; o->start=k->start; o->end=k->end; o->graphNode=k->graphNodeId; o->graphId=k->graphId; o->stream=k->streamId; strncpy(o->name, k->name?k->name:"?", 47);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      CUpti_ActivityMemcpy6 *k = (CUpti_ActivityMemcpy6*)r; o->corr=k->correlationId; o->start=k->start; o->end=k->end; o->graphNode=k->graphNodeId; o->stream=k->streamId; snprintf(o->name,47,"memcpy kind %d bytes %llu", k->copyKind, (unsigned long long)k->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      CUpti_ActivityMemset4 *k = (CUpti_ActivityMemset4*)r; o->corr=k->correlationId; o->start=k->start; o->end=k->end; o->graphNode=k->graphNodeId; o->stream=k->streamId; snprintf(o->name,47,"memset bytes %llu", (unsigned long long)k->bytes);
    } else { snprintf(o->name,47,"other kind %d", r->kind); }
    nrec++;
  }
  size_t d = 0; cuptiActivityGetNumDroppedRecords(ctx, sid, &d); dropped += d;
  pthread_mutex_unlock(&mu); free(b);
}
typedef struct { int domain; uint32_t cbid, corr; char fn[40]; char sym[48]; } Cb;
static Cb cbs[200000]; static int ncb; static int all_cb;
static void CUPTIAPI cb(void *u, CUpti_CallbackDomain d, CUpti_CallbackId id, const void *data){
  const CUpti_CallbackData *c = (const CUpti_CallbackData*)data; __sync_fetch_and_add(&all_cb,1);
  if (c->callbackSite != CUPTI_API_ENTER) return;
  const char *f = c->functionName ? c->functionName : "";
  if (!(strstr(f,"aunch") || strstr(f,"emcpy") || strstr(f,"emset"))) return;
  int i = __sync_fetch_and_add(&ncb,1); if (i >= 200000) return;
  cbs[i].domain = d; cbs[i].cbid = id; cbs[i].corr = c->correlationId; strncpy(cbs[i].fn, f, 39); strncpy(cbs[i].sym, c->symbolName ? c->symbolName : "-", 47);
}
static double launch_cost(cudaStream_t s, int n){ uint64_t t0=mono(); for(int i=0;i<n;i++) empty<<<1,1,0,s>>>(); uint64_t t1=mono(); cudaStreamSynchronize(s); return (double)(t1-t0)/n; }

int main(int argc, char **argv){
  int use_mono = argc > 1 && !strcmp(argv[1], "mono");
  uint32_t v=0; CK(cuptiGetVersion(&v)); printf("cuptiGetVersion %u (header %d), timestamps: %s\n", v, CUPTI_API_VERSION, use_mono?"callback CLOCK_MONOTONIC":"CUPTI default");
  CC(cudaFree(0)); cudaStream_t s; CC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int w=0; w<3; w++) launch_cost(s, 2000);
  double base = launch_cost(s, 20000);
  if (use_mono) CK(cuptiActivityRegisterTimestampCallback(ts_cb));
  CK(cuptiActivityRegisterCallbacks(req, done));
  CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)); CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY)); CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  double with_act = launch_cost(s, 20000);
  CUpti_SubscriberHandle sub; CK(cuptiSubscribe(&sub, cb, NULL));
  CK(cuptiEnableDomain(1, sub, CUPTI_CB_DOMAIN_DRIVER_API)); CK(cuptiEnableDomain(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API));
  double with_cb = launch_cost(s, 20000);
  CUpti_SubscriberHandle sub2; CUptiResult r2 = cuptiSubscribe(&sub2, cb, NULL); const char *rs; cuptiGetResultString(r2,&rs); printf("second cuptiSubscribe -> %d %s\n", r2, rs);
  printf("launch cost ns: no CUPTI %.0f, activity %.0f, activity+callbacks(all driver+runtime) %.0f\n", base, with_act, with_cb);
  uint64_t t_f0 = mono(); CK(cuptiActivityFlushAll(1)); printf("flush after 60000 kernels: %.0f us\n", (mono()-t_f0)/1e3);
  pthread_mutex_lock(&mu); int first = nrec; int firstcb = ncb; pthread_mutex_unlock(&mu);
  unsigned long long *h, *dptr; CC(cudaHostAlloc((void**)&h, 8*256, cudaHostAllocMapped)); CC(cudaHostGetDevicePointer((void**)&dptr, h, 0));
  uint64_t t0s[64], t1s[64], r0s[64], r1s[64];
  for (int i=0;i<64;i++){ h[i]=0; r0s[i]=clk(CLOCK_REALTIME); t0s[i]=mono(); stamp<<<1,1,0,s>>>(dptr+i); while(((volatile unsigned long long*)h)[i]==0){} t1s[i]=mono(); r1s[i]=clk(CLOCK_REALTIME); usleep(2000); }
  // driver API launch of the same kernel
  cudaFunction_t fn; CC(cudaGetFuncBySymbol(&fn, (const void*)stamp)); unsigned long long *spare = dptr + 128; void *args[] = { &spare }; CUresult dr = cuLaunchKernel((CUfunction)fn, 1,1,1,1,1,1,0,(CUstream)s,args,NULL); printf("cuLaunchKernel -> %d\n", dr);
  // memcpy / memset
  void *d; CC(cudaMalloc(&d, 1<<20)); char *hb=(char*)malloc(1<<20); CC(cudaMemcpyAsync(d,hb,1<<20,cudaMemcpyHostToDevice,s)); CC(cudaMemsetAsync(d,0,1<<20,s)); CC(cudaMemcpy(hb,d,1<<20,cudaMemcpyDeviceToHost)); cuMemsetD8Async((CUdeviceptr)d, 1, 1<<20, (CUstream)s);
  // a graph of 3 kernels, launched 3 times
  cudaGraph_t g; cudaGraphExec_t ge; CC(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal)); spin<<<1,1,0,s>>>(5000); empty<<<2,32,0,s>>>(); spin<<<1,1,0,s>>>(3000); CC(cudaStreamEndCapture(s,&g)); CC(cudaGraphInstantiate(&ge,g,0));
  for(int i=0;i<3;i++) CC(cudaGraphLaunch(ge,s));
  CC(cudaStreamSynchronize(s)); CC(cudaDeviceSynchronize());
  t_f0 = mono(); CK(cuptiActivityFlushAll(1)); printf("flush: %.0f us\n", (mono()-t_f0)/1e3);
  pthread_mutex_lock(&mu);
  printf("records %d (before probe %d), buffers %d, dropped %zu, callbacks %d (launch-like %d)\n", nrec, first, buffers, dropped, all_cb, ncb);
  // stamps: the kernel records after `first`, named stamp, in order
  int k = 0;
  printf("i corr | start-t0 | t1-end | end-start | G-start | resid(start - mono bracket mid)\n");
  for (int i=first;i<nrec && k<64;i++){
    if (recs[i].kind!=CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || !strstr(recs[i].name,"stamp")) continue;
    Rec *o=&recs[i]; long long G = (long long)h[k];
    uint64_t b0 = use_mono? t0s[k] : r0s[k], b1 = use_mono? t1s[k] : r1s[k];
    if (k<12 || k>60) printf("%d %u | %lld | %lld | %lld | %lld | start mod 32 = %llu\n", k, o->corr, (long long)(o->start-b0), (long long)(b1-o->end), (long long)(o->end-o->start), G-(long long)o->start, (unsigned long long)(o->start%32));
    k++;
  }
  // G vs start relation over the 64 stamps: offset first/last
  { int a=-1,b=-1,kk=0; for (int i=first;i<nrec;i++){ if (recs[i].kind!=CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || !strstr(recs[i].name,"stamp")) continue; if(kk==0)a=i; if(kk==63)b=i; kk++; }
    if (a>=0&&b>=0){ long long dG = (long long)(h[63]-h[0]); long long dS = (long long)(recs[b].start-recs[a].start); printf("over the stamps: dG %lld ns, dStart %lld ns, (dS-dG)/dG = %.3f ppm; mono dT %lld\n", dG, dS, 1e6*(double)(dS-dG)/dG, (long long)(t0s[63]-t0s[0])); } }
  for (int i=first;i<nrec;i++) if (!strstr(recs[i].name,"stamp")) printf("rec kind %d corr %u stream %u graphId %u node %llu dur %llu name %s\n", recs[i].kind, recs[i].corr, recs[i].stream, recs[i].graphId, (unsigned long long)recs[i].graphNode, (unsigned long long)(recs[i].end-recs[i].start), recs[i].name);
  for (int i=firstcb;i<ncb;i++) if (!strstr(cbs[i].sym,"stamp") || i < firstcb+2 || i > ncb-12) printf("cb domain %d cbid %u corr %u fn %s sym %s\n", cbs[i].domain, cbs[i].cbid, cbs[i].corr, cbs[i].fn, cbs[i].sym);
  pthread_mutex_unlock(&mu);
  return 0;
}
